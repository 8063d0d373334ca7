//! The raw CUDA layer (feature `cuda`) every kernel file builds on: the device of a tensor and
//! the raw addresses of its buffers, the kernel files loaded once per device ordinal, launching,
//! and values cached per device. It knows nothing of GPTQ; the GPU solve lives in `crate::gptq`
//! (`gptq/cuda.rs`).
//!
//! The kernel files (`gptq.cu`, `infllm.cu`, `gla.cu`) are compiled by `build.rs` to fatbins (sm
//! SASS plus PTX) and loaded with no JIT (docs/gpu.md, No JIT on first use).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use anyhow::{bail, ensure, Context, Result};
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, DType, Device, Storage, Tensor};
use cudarc::driver::{
    CudaModule, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::Ptx;

/// The kernel files as fatbins (SASS for the build's compute capability plus its PTX), by the
/// name [`launch_in`] takes: the driver loads the machine code as is, with no JIT on first use
/// (docs/gpu.md, No JIT on first use).
static FATBINS: &[(&str, &[u8])] = &[
    (
        "gptq",
        include_bytes!(concat!(env!("OUT_DIR"), "/gptq.fatbin")),
    ),
    (
        "infllm",
        include_bytes!(concat!(env!("OUT_DIR"), "/infllm.fatbin")),
    ),
    (
        "gla",
        include_bytes!(concat!(env!("OUT_DIR"), "/gla.fatbin")),
    ),
];

pub fn cuda(device: &Device) -> Result<&CudaDevice> {
    match device {
        Device::Cuda(d) => Ok(d),
        other => bail!("expected a CUDA device, got {other:?}"),
    }
}

/// The raw device address of a contiguous CUDA tensor's first element, valid while the tensor
/// lives. All work runs on the device's one stream, so no cross-stream events are needed.
pub fn tensor_ptr(t: &Tensor) -> Result<u64> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(cs) = &*storage else {
        bail!("tensor is not on a CUDA device");
    };
    ensure!(
        layout.is_contiguous(),
        "internal: a CUDA kernel was given a non-contiguous tensor"
    );
    let stream = cs.device.cuda_stream();
    let base = match t.dtype() {
        DType::F32 => slice_ptr(cs.as_cuda_slice::<f32>()?, &stream),
        DType::F64 => slice_ptr(cs.as_cuda_slice::<f64>()?, &stream),
        DType::BF16 => slice_ptr(cs.as_cuda_slice::<half::bf16>()?, &stream),
        DType::F16 => slice_ptr(cs.as_cuda_slice::<half::f16>()?, &stream),
        DType::U8 => slice_ptr(cs.as_cuda_slice::<u8>()?, &stream),
        DType::U32 => slice_ptr(cs.as_cuda_slice::<u32>()?, &stream),
        DType::I32 => slice_ptr(cs.as_cuda_slice::<i32>()?, &stream),
        other => bail!("internal: no CUDA kernel takes {other:?} tensors"),
    };
    Ok(base + (layout.start_offset() * t.dtype().size_in_bytes()) as u64)
}

pub fn slice_ptr<T>(s: &CudaSlice<T>, stream: &Arc<CudaStream>) -> u64 {
    let (p, _sync) = s.device_ptr(stream);
    p
}

/// A tensor that takes ownership of a device buffer.
pub fn wrap<T: candle_core::cuda_backend::CudaDType>(
    slice: CudaSlice<T>,
    dev: &CudaDevice,
    shape: &[usize],
) -> Tensor {
    let storage = CudaStorage::wrap_cuda_slice(slice, dev.clone());
    Tensor::from_storage(Storage::Cuda(storage), shape, BackpropOp::none(), false)
}

/// Launches `name` from `gptq.cu` with the arguments pushed by `args`.
pub fn launch(
    dev: &CudaDevice,
    name: &str,
    cfg: LaunchConfig,
    args: &[&dyn KernelArg],
) -> Result<()> {
    launch_in(dev, "gptq", name, cfg, args)
}

/// Launches `name` from the kernel file `file` (`gptq`, `infllm`, `gla`: `src/kernels/{file}.cu`)
/// with the arguments pushed by `args`. Dynamic shared memory past the default 48 KiB
/// (`cfg.shared_mem_bytes`) is allowed on the function first.
pub fn launch_in(
    dev: &CudaDevice,
    file: &str,
    name: &str,
    cfg: LaunchConfig,
    args: &[&dyn KernelArg],
) -> Result<()> {
    let f = kernel_module(dev, file)?
        .load_function(name)
        .with_context(|| format!("loading CUDA kernel {name}"))?;
    if cfg.shared_mem_bytes > 48 * 1024 {
        f.set_attribute(
            cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            cfg.shared_mem_bytes as i32,
        )
        .with_context(|| {
            format!(
                "allowing {} bytes of shared memory to CUDA kernel {name}",
                cfg.shared_mem_bytes
            )
        })?;
    }
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&f);
    for a in args {
        a.push(&mut b);
    }
    unsafe { b.launch(cfg) }.with_context(|| format!("launching CUDA kernel {name}"))?;
    Ok(())
}

/// A scalar kernel argument (device addresses are passed as `u64`).
pub trait KernelArg {
    fn push<'a>(&'a self, b: &mut cudarc::driver::LaunchArgs<'a>);
}
impl<T: DeviceRepr> KernelArg for T {
    fn push<'a>(&'a self, b: &mut cudarc::driver::LaunchArgs<'a>) {
        b.arg(self);
    }
}

/// The `(B, T, H, D)` of an attention kernel's query and the KV head count of its key, with the
/// key and value checked to be `[B, T, KV, D]`; `what` names the kernel in the message.
pub fn qkv_dims(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    what: &str,
) -> Result<(usize, usize, usize, usize, usize)> {
    let (b, t, h, d) = q.dims4()?;
    let (_, _, kv, _) = k.dims4()?;
    ensure!(
        k.dims() == [b, t, kv, d] && v.dims() == k.dims(),
        "internal: {what} operands differ: q {:?}, k {:?}, v {:?}",
        q.dims(),
        k.dims(),
        v.dims()
    );
    Ok((b, t, h, d, kv))
}

pub fn blocks(n: usize, per: usize) -> u32 {
    n.div_ceil(per) as u32
}

pub fn launch_cfg(grid: (u32, u32, u32), block: (u32, u32, u32)) -> LaunchConfig {
    LaunchConfig {
        grid_dim: grid,
        block_dim: block,
        shared_mem_bytes: 0,
    }
}

/// The module of `src/kernels/{file}.cu`, loaded once per device ordinal (candle's devices
/// share the primary context of their ordinal).
fn kernel_module(dev: &CudaDevice, file: &str) -> Result<Arc<CudaModule>> {
    type Modules = Mutex<HashMap<(usize, String), Arc<CudaModule>>>;
    static MODULES: OnceLock<Modules> = OnceLock::new();
    let Some((_, bytes)) = FATBINS.iter().find(|(n, _)| *n == file) else {
        bail!("internal: no CUDA kernel file {file}");
    };
    let key = (dev.cuda_stream().context().ordinal(), file.to_string());
    let cache = MODULES.get_or_init(Default::default);
    if let Some(m) = cache.lock().expect("module cache poisoned").get(&key) {
        return Ok(m.clone());
    }
    let m = dev
        .cuda_stream()
        .context()
        .load_module(Ptx::from_binary(bytes.to_vec()))
        .with_context(|| format!("loading the soar-gptq CUDA kernels ({file}.fatbin)"))?;
    cache
        .lock()
        .expect("module cache poisoned")
        .insert(key, m.clone());
    Ok(m)
}

/// A cache of one value per device ordinal.
pub(super) type PerOrdinal<T> = OnceLock<Mutex<HashMap<usize, T>>>;

/// The value `cache` holds for `dev`'s ordinal, made by `make` (with the device's stream) on
/// first use.
pub(super) fn per_ordinal<T: Clone>(
    cache: &PerOrdinal<T>,
    dev: &CudaDevice,
    make: impl FnOnce(&Arc<CudaStream>) -> Result<T>,
) -> Result<T> {
    let stream = dev.cuda_stream();
    let ordinal = stream.context().ordinal();
    let mut map = cache
        .get_or_init(Default::default)
        .lock()
        .expect("per-device cache poisoned");
    if let Some(v) = map.get(&ordinal) {
        return Ok(v.clone());
    }
    let v = make(&stream)?;
    map.insert(ordinal, v.clone());
    Ok(v)
}

pub fn upload<T: DeviceRepr>(stream: &Arc<CudaStream>, v: &[T]) -> Result<CudaSlice<T>> {
    Ok(stream.clone_htod(v)?)
}
