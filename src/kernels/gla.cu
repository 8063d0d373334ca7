// Fused chunked Simple-GLA (src/model/gla.rs is its CPU twin). Filled in by the GLA work.
#include <stdint.h>
