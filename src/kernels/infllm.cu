// InfLLM-v2 kernels (src/model/infllm.rs is their CPU twin). Filled in by the InfLLM-v2 work.
#include <stdint.h>
