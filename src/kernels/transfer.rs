//! Transfers through page-locked host memory, at the link's speed instead of the driver's staged
//! copy of pageable memory: the codes of a solve to the host ([`codes_to_host`]), the next
//! decoder layer's weights to the device ([`PinnedStage`]), and the per-batch layer caches that
//! do not fit the GPU, out and back on a second stream beside the computation ([`CopyStream`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use anyhow::{anyhow, ensure, Result};
use candle_core::{DType, Device, Tensor};
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, HostSlice};
use rayon::prelude::*;

use super::cuda::{cuda, wrap};

/// The page-locked staging buffer of `codes_to_host`, kept between solves (allocating and
/// registering page-locked memory costs more than the copy it speeds up).
static PINNED_CODES: Mutex<Option<cudarc::driver::PinnedHostSlice<u8>>> = Mutex::new(None);

/// The codes of a solve on the host: a DMA into a reused page-locked buffer and one parallel
/// copy out of it (docs/decisions.md, Codes leave the GPU through a page-locked staging buffer: a plain pageable copy was up to 2× slower).
pub fn codes_to_host(stream: &Arc<CudaStream>, codes: &CudaSlice<u8>) -> Result<Vec<u8>> {
    let n = codes.len();
    let ctx = stream.context();
    let mut staging = PINNED_CODES
        .lock()
        .map_err(|_| anyhow!("internal: poisoned lock"))?;
    let fits = staging
        .as_ref()
        .is_some_and(|p| p.len() >= n && Arc::ptr_eq(p.context(), ctx));
    if !fits {
        *staging = None;
        // Flags 0: cached, readable by the CPU at full speed (not write-combined).
        *staging = Some(unsafe { ctx.alloc_pinned_with_flags::<u8>(n, 0) }?);
    }
    let buf = staging.as_mut().expect("just set").as_mut_slice()?;
    let (src, _record) = codes.device_ptr(stream);
    unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut buf[..n], src, stream.cu_stream()) }?;
    stream.synchronize()?;
    // Out of the staging buffer with all cores: the copy is bound by the first touch of the
    // destination's fresh pages (measured on the H200 host: 67 MB took 45 ms on one thread).
    // `vec![0; n]` maps zero pages lazily, so every page is touched once, by the copy.
    let mut out = vec![0u8; n];
    const CHUNK: usize = 1 << 20;
    out.par_chunks_mut(CHUNK)
        .zip(buf[..n].par_chunks(CHUNK))
        .for_each(|(d, s)| d.copy_from_slice(s));
    Ok(out)
}

/// Page-locked host memory for a decoder layer's weights on their way to the GPU: filled from
/// the mapped checkpoint on a thread beside the computation ([`PinnedStage::fill`], plain host
/// copies, no CUDA call), then copied to the device one DMA per tensor ([`PinnedStage::upload`]),
/// at the link's speed instead of the driver's staged copy of pageable memory.
pub struct PinnedStage {
    buf: cudarc::driver::PinnedHostSlice<u8>,
    /// Tensor name → byte range in `buf`, of what the last fill holds.
    held: HashMap<String, std::ops::Range<usize>>,
}

impl PinnedStage {
    /// A stage of `bytes` bytes on `device`'s context (allocate on the thread that computes).
    pub fn new(device: &Device, bytes: usize) -> Result<Self> {
        let dev = cuda(device)?;
        let ctx = dev.cuda_stream().context().clone();
        // Flags 0: cached, so the filling thread writes at full speed (not write-combined).
        let buf = unsafe { ctx.alloc_pinned_with_flags::<u8>(bytes.max(1), 0) }?;
        Ok(Self {
            buf,
            held: HashMap::new(),
        })
    }

    pub fn capacity(&self) -> usize {
        self.buf.len()
    }

    /// Copies `tensors` (name and bytes) in, back to back, replacing what the stage held (host
    /// copies; `as_mut_slice` only binds the context). The caller makes sure no upload from the
    /// stage is still in flight: the layer loop synchronizes the device after each load.
    pub fn fill(&mut self, tensors: &[(String, &[u8])]) -> Result<()> {
        let total: usize = tensors.iter().map(|(_, b)| b.len()).sum();
        ensure!(
            total <= self.buf.len(),
            "internal: {total} bytes do not fit a {}-byte stage",
            self.buf.len()
        );
        self.held.clear();
        let host = self.buf.as_mut_slice()?;
        let mut off = 0;
        let mut dests = vec![];
        let mut rest = &mut host[..total];
        for (name, bytes) in tensors {
            let (d, r) = rest.split_at_mut(bytes.len());
            dests.push((d, *bytes));
            rest = r;
            self.held.insert(name.clone(), off..off + bytes.len());
            off += bytes.len();
        }
        const CHUNK: usize = 4 << 20;
        dests.into_par_iter().for_each(|(d, b)| {
            d.par_chunks_mut(CHUNK)
                .zip(b.par_chunks(CHUNK))
                .for_each(|(d, b)| d.copy_from_slice(b));
        });
        Ok(())
    }

    /// Tensor `name` from the stage as `dtype` (stored as `stored`) with `shape`, on `device`;
    /// `None` when the stage does not hold it.
    pub fn upload(
        &self,
        device: &Device,
        name: &str,
        stored: DType,
        shape: &[usize],
    ) -> Result<Option<Tensor>> {
        let Some(range) = self.held.get(name).cloned() else {
            return Ok(None);
        };
        let dev = cuda(device)?;
        let stream = dev.cuda_stream();
        let n: usize = shape.iter().product();
        ensure!(
            n * stored.size_in_bytes() == range.len(),
            "internal: staged tensor {name} has {} bytes, its shape {shape:?} needs {}",
            range.len(),
            n * stored.size_in_bytes()
        );
        let host = &self.buf.as_slice()?[range];
        macro_rules! copy {
            ($t:ty) => {{
                let dst: CudaSlice<$t> = unsafe { stream.alloc(n) }?;
                let (ptr, _record) = dst.device_ptr(&stream);
                unsafe {
                    cudarc::driver::result::memcpy_htod_async(ptr, host, stream.cu_stream())
                }?;
                drop(_record);
                wrap(dst, dev, shape)
            }};
        }
        let t = match stored {
            DType::BF16 => copy!(half::bf16),
            DType::F16 => copy!(half::f16),
            DType::F32 => copy!(f32),
            // Anything else loads from the checkpoint.
            _ => return Ok(None),
        };
        Ok(Some(t))
    }
}

/// One tensor held in page-locked host memory between two passes over a layer (a batch's
/// mixer output that the GPU budget could not keep). The buffer is reused from layer to layer.
pub struct PinnedTensor {
    buf: cudarc::driver::PinnedHostSlice<u8>,
    dtype: DType,
    shape: Vec<usize>,
}

impl PinnedTensor {
    pub fn capacity(&self) -> usize {
        self.buf.len()
    }
}

/// A copy queued on the copy stream, and the device tensor it reads (device to host) or writes
/// (host to device). The device's stream waits for the copy before the tensor is used
/// ([`InFlight::finish`]) or freed (when dropped unfinished).
pub struct InFlight {
    tensor: Option<Tensor>,
    done: CudaEvent,
    main: Arc<CudaStream>,
}

impl InFlight {
    /// The tensor, for the device's stream: the stream waits for the copy before anything
    /// queued after this call.
    pub fn finish(mut self) -> Result<Tensor> {
        self.main.wait(&self.done)?;
        Ok(self
            .tensor
            .take()
            .expect("an unfinished copy holds its tensor"))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if self.tensor.is_some() {
            // The tensor's memory returns to the stream-ordered pool on the device's stream:
            // only after the copy that reads or writes it.
            let _ = self.main.wait(&self.done);
        }
    }
}

/// A second stream on the device's context for copies between the device and page-locked host
/// memory, so that they overlap the computation on the device's own stream (which candle and
/// every kernel use). Every copy starts after the work queued on the device's stream so far, and
/// the device's stream waits for a copy before it uses or frees the tensor ([`InFlight`]);
/// buffers are written and read in the copy stream's order.
pub struct CopyStream {
    dev: candle_core::CudaDevice,
    main: Arc<CudaStream>,
    copy: Arc<CudaStream>,
}

impl CopyStream {
    pub fn new(device: &Device) -> Result<Self> {
        let dev = cuda(device)?.clone();
        let main = dev.cuda_stream();
        let copy = main.context().new_stream()?;
        Ok(Self { dev, main, copy })
    }

    /// A page-locked buffer of `bytes` bytes (cached: the CPU never reads it).
    pub fn alloc(&self, bytes: usize) -> Result<PinnedTensor> {
        let buf = unsafe {
            self.main
                .context()
                .alloc_pinned_with_flags::<u8>(bytes.max(1), 0)
        }?;
        Ok(PinnedTensor {
            buf,
            dtype: DType::U8,
            shape: vec![0],
        })
    }

    /// The copy stream waits for what the device's stream has queued so far.
    fn after_main(&self) -> Result<()> {
        let queued = self.main.record_event(None)?;
        self.copy.wait(&queued)?;
        Ok(())
    }

    /// Queues the copy of `t` (a contiguous CUDA tensor) into `dst`; `t` is held by the
    /// returned copy until [`finish`](Self::finish).
    pub fn store(&self, t: &Tensor, dst: &mut PinnedTensor) -> Result<InFlight> {
        let t = t.contiguous()?;
        let n = t.elem_count() * t.dtype().size_in_bytes();
        ensure!(
            n <= dst.capacity(),
            "internal: a {n}-byte tensor does not fit a {}-byte page-locked buffer",
            dst.capacity()
        );
        self.after_main()?;
        let src = super::cuda::tensor_ptr(&t)?;
        {
            let (host, _record) = unsafe { dst.buf.stream_synced_mut_slice(&self.copy) };
            unsafe {
                cudarc::driver::result::memcpy_dtoh_async(
                    &mut host[..n],
                    src,
                    self.copy.cu_stream(),
                )
            }?;
        }
        dst.dtype = t.dtype();
        dst.shape = t.dims().to_vec();
        self.in_flight(t)
    }

    /// Queues the copy of what `src` holds into a new tensor on the device.
    pub fn load(&self, src: &PinnedTensor) -> Result<InFlight> {
        let shape = src.shape.clone();
        let n: usize = shape.iter().product();
        let bytes = n * src.dtype.size_in_bytes();
        macro_rules! copy {
            ($t:ty) => {{
                let mut dst: CudaSlice<$t> = unsafe { self.main.alloc(n) }?;
                self.after_main()?;
                {
                    let (ptr, _record) = dst.device_ptr_mut(&self.copy);
                    let (host, _hrec) = unsafe { src.buf.stream_synced_slice(&self.copy) };
                    unsafe {
                        cudarc::driver::result::memcpy_htod_async(
                            ptr,
                            &host[..bytes],
                            self.copy.cu_stream(),
                        )
                    }?;
                }
                wrap(dst, &self.dev, &shape)
            }};
        }
        let tensor = match src.dtype {
            DType::BF16 => copy!(half::bf16),
            DType::F16 => copy!(half::f16),
            DType::F32 => copy!(f32),
            other => anyhow::bail!("internal: no page-locked copy of {other:?} tensors"),
        };
        self.in_flight(tensor)
    }

    /// `tensor` held until the copies queued so far are done.
    fn in_flight(&self, tensor: Tensor) -> Result<InFlight> {
        Ok(InFlight {
            tensor: Some(tensor),
            done: self.copy.record_event(None)?,
            main: self.main.clone(),
        })
    }
}
