//! What the GPU holds and can do: free, used and total memory, the stream-ordered pool candle
//! allocates from (kept reserved, its high-water marks), and the FP64 rate.

use anyhow::Result;
use candle_core::{CudaDevice, Device};

use super::cuda::cuda;

/// GPU memory free on `device` right now, in bytes.
pub fn memory_free(device: &Device) -> Result<u64> {
    let dev = cuda(device)?;
    let (free, _) = dev.cuda_stream().context().mem_get_info()?;
    Ok(free as u64)
}

/// GPU memory in use on `device` right now (total − free), in bytes.
pub fn memory_in_use(device: &Device) -> Result<u64> {
    let dev = cuda(device)?;
    let (free, total) = dev.cuda_stream().context().mem_get_info()?;
    Ok((total - free) as u64)
}

/// How many times the GPU's FP32 rate its FP64 rate is (2 on an H100, 64 on RTX and
/// workstation Blackwell cards): the driver's `SINGLE_TO_DOUBLE_PRECISION_PERF_RATIO`.
pub fn fp32_to_fp64_ratio(device: &Device) -> Result<i32> {
    let dev = cuda(device)?;
    Ok(dev.cuda_stream().context().attribute(
        cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_SINGLE_TO_DOUBLE_PRECISION_PERF_RATIO,
    )?)
}

/// Total GPU memory of `device`, in bytes.
pub fn memory_total(device: &Device) -> Result<u64> {
    let dev = cuda(device)?;
    Ok(dev.cuda_stream().context().total_mem()? as u64)
}

fn default_pool(dev: &CudaDevice) -> Result<cudarc::driver::sys::CUmemoryPool> {
    use cudarc::driver::sys;
    let ctx = dev.cuda_stream().context().clone();
    ctx.bind_to_thread()?;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) }.result()?;
    Ok(pool)
}

/// Keeps memory freed to the stream-ordered pool (which candle allocates from) reserved instead
/// of returning it to the driver at every synchronization: the pipeline frees and re-allocates
/// the same large buffers layer after layer. Also resets the pool's high-water marks.
pub fn keep_pool_memory(device: &Device) -> Result<()> {
    use cudarc::driver::sys::CUmemPool_attribute as A;
    let pool = default_pool(cuda(device)?)?;
    let mut threshold = u64::MAX;
    let mut zero = 0u64;
    unsafe {
        cudarc::driver::sys::cuMemPoolSetAttribute(
            pool,
            A::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            &mut threshold as *mut u64 as *mut _,
        )
        .result()?;
        for attr in [
            A::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
            A::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
        ] {
            cudarc::driver::sys::cuMemPoolSetAttribute(pool, attr, &mut zero as *mut u64 as *mut _)
                .result()?;
        }
    }
    Ok(())
}

/// The stream-ordered pool's high-water marks since [`keep_pool_memory`]: `(used, reserved)`
/// bytes. Allocations outside the pool (the context, cuBLAS and cuSOLVER workspaces) are not in
/// these; [`memory_in_use`] sees everything at one instant.
pub fn pool_high_water(device: &Device) -> Result<(u64, u64)> {
    use cudarc::driver::sys::CUmemPool_attribute as A;
    let pool = default_pool(cuda(device)?)?;
    let read = |attr| -> Result<u64> {
        let mut v = 0u64;
        unsafe {
            cudarc::driver::sys::cuMemPoolGetAttribute(pool, attr, &mut v as *mut u64 as *mut _)
        }
        .result()?;
        Ok(v)
    };
    Ok((
        read(A::CU_MEMPOOL_ATTR_USED_MEM_HIGH)?,
        read(A::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)?,
    ))
}
