//! The CUDA device: driver context, stream, kernel module table, device and pinned buffers, kernel launches.
//!
//! Everything goes through cudarc's dynamic loading, and every entry point checks that the library is
//! there first, so a machine without CUDA gets `Error::Device`, never a panic.

use std::ffi::{c_void, CString};
use std::sync::{Arc, OnceLock};

use cudarc::driver::{result, sys, CudaContext, CudaModule, CudaStream};

use crate::error::{Error, Result};

include!(concat!(env!("OUT_DIR"), "/kernel_modules.rs"));

pub fn device_err(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Device(format!("{what}: {e:?}"))
}

/// Number of usable CUDA devices; 0 when no driver is installed (never panics).
pub fn device_count() -> usize {
    // SAFETY: only probes whether the shared library can be opened.
    if !unsafe { sys::is_culib_present() } {
        return 0;
    }
    if result::init().is_err() {
        return 0;
    }
    result::device::get_count().map(|n| n.max(0) as usize).unwrap_or(0)
}

/// A kernel handle. CUfunction is a plain driver handle, valid for the context's lifetime.
#[derive(Clone, Copy)]
pub struct Func(sys::CUfunction);
// SAFETY: driver function handles may be used from any thread once the context is current there.
unsafe impl Send for Func {}
unsafe impl Sync for Func {}

/// One kernel argument; every kind fits in one 8-byte slot (the driver reads the first 4 bytes of 4-byte ones).
#[derive(Clone, Copy)]
pub enum Arg {
    Ptr(u64),
    I32(i32),
    U32(u32),
    F32(f32),
}

impl Arg {
    fn slot(self) -> u64 {
        match self {
            Arg::Ptr(p) => p,
            Arg::I32(i) => i as u32 as u64,
            Arg::U32(u) => u as u64,
            Arg::F32(f) => f.to_bits() as u64,
        }
    }
}

/// One kernel module of the build, loaded when a kernel of it is first asked for, so that kernels a model never
/// uses (the fp8-cache attention of a bf16-cache model) cost no load time.
struct Module {
    name: &'static str,
    image: Image,
    loaded: OnceLock<Arc<CudaModule>>,
}

/// What the driver loads for a module (build.rs).
#[derive(Clone, Copy)]
enum Image {
    /// compute_80 PTX, JIT-compiled for the device before Hopper.
    Ptx(&'static str),
    /// sm_90 machine code (loaded as it is on compute capability 9.0) and compute_90 PTX (JIT-compiled on newer
    /// devices), built with programmatic dependent launch.
    Fatbin(&'static [u8]),
}

/// The context, its one stream, and the modules.
pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    modules: Vec<Module>,
    pub sm_count: usize,
    /// Compute capability 9.0 or newer: the compute_90 PTX is loaded, with its Hopper-only kernels.
    pub hopper: bool,
    /// Kernels are launched with programmatic dependent launch (compute capability 9.0 and up, unless
    /// STEPLLM_NO_PDL is set): each may start while the previous one finishes (see kernels/common.cuh).
    pub pdl: bool,
}

impl Gpu {
    pub fn new(ordinal: usize) -> Result<Self> {
        if KERNEL_MODULES.is_empty() {
            return Err(Error::Device(
                "stepllm was built without CUDA kernels: install cuda-toolkit[nvcc,cccl]==13.0.* with pip (or set \
                 NVCC) and rebuild"
                    .into(),
            ));
        }
        let count = device_count();
        if count == 0 {
            return Err(Error::Device(
                "no CUDA device: the CUDA driver (libcuda.so) is missing or sees no GPU; use device=\"cpu\"".into(),
            ));
        }
        if ordinal >= count {
            return Err(Error::Device(format!("cuda:{ordinal} asked for but only {count} CUDA device(s) exist")));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| device_err("creating the CUDA context", e))?;
        // One stream and no cross-stream bookkeeping: every op is ordered on it, which graph capture needs.
        // SAFETY: we never share cudarc slices between streams.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(|e| device_err("creating a CUDA stream", e))?;
        let attribute = |a, what: &str| ctx.attribute(a).map_err(|e| device_err(what, e));
        let major = attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, "reading the compute capability")?;
        let hopper_or_newer = major >= 9;
        let modules = KERNEL_MODULES
            .iter()
            .map(|&(name, base, pdl)| Module {
                name,
                image: if hopper_or_newer { Image::Fatbin(pdl) } else { Image::Ptx(base) },
                loaded: OnceLock::new(),
            })
            .collect();
        let sm_count =
            attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, "reading the multiprocessor count")? as usize;
        let pdl = hopper_or_newer && std::env::var_os("STEPLLM_NO_PDL").is_none();
        Ok(Self { ctx, stream, modules, sm_count, hopper: hopper_or_newer, pdl })
    }

    /// Make the context current on the calling thread (the engine thread differs from the loading one).
    pub fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(|e| device_err("binding the CUDA context", e))
    }

    pub fn function(&self, module: &str, name: &str) -> Result<Func> {
        let m = self.module(module)?;
        let f = m.load_function(name).map_err(|e| device_err(&format!("kernel {module}::{name}"), e))?;
        Ok(Func(f.cu_function()))
    }

    fn module(&self, name: &str) -> Result<&Arc<CudaModule>> {
        let m = self
            .modules
            .iter()
            .find(|m| m.name == name)
            .ok_or_else(|| Error::Device(format!("kernel module {name} missing from this build")))?;
        if let Some(loaded) = m.loaded.get() {
            return Ok(loaded);
        }
        let image = match m.image {
            Image::Ptx(ptx) => cudarc::nvrtc::Ptx::from_src(ptx),
            Image::Fatbin(bytes) => cudarc::nvrtc::Ptx::from_binary(bytes.to_vec()),
        };
        let loaded = self
            .ctx
            .load_module(image)
            .map_err(|e| device_err(&format!("loading kernel module {name} (driver older than CUDA 13.0?)"), e))?;
        // Two threads loading at once both succeed; the first one's module is kept.
        Ok(m.loaded.get_or_init(|| loaded))
    }

    pub fn cu_stream(&self) -> sys::CUstream {
        self.stream.cu_stream()
    }

    /// Launch `f` on the stream with a 1-D block.
    pub fn launch(&self, f: Func, grid: (u32, u32, u32), block: u32, args: &[Arg]) -> Result<()> {
        self.launch_smem(f, grid, block, 0, args)
    }

    /// [`Gpu::launch`] with `smem` bytes of dynamic shared memory.
    pub fn launch_smem(&self, f: Func, grid: (u32, u32, u32), block: u32, smem: u32, args: &[Arg]) -> Result<()> {
        self.launch_ordered(f, grid, block, smem, args, self.pdl)
    }

    /// [`Gpu::launch`] without programmatic dependent launch: `f` starts once the work before it is complete and
    /// its writes are visible, so it may read what that work wrote before its griddepcontrol.wait.
    pub fn launch_plain(&self, f: Func, grid: (u32, u32, u32), block: u32, args: &[Arg]) -> Result<()> {
        self.launch_ordered(f, grid, block, 0, args, false)
    }

    fn launch_ordered(&self, f: Func, grid: (u32, u32, u32), block: u32, smem: u32, args: &[Arg], programmatic: bool) -> Result<()> {
        const MAX_ARGS: usize = 24;
        assert!(args.len() <= MAX_ARGS, "kernel launch with more than {MAX_ARGS} arguments");
        let mut slots = [0u64; MAX_ARGS];
        let mut ptrs = [std::ptr::null_mut::<c_void>(); MAX_ARGS];
        for (i, a) in args.iter().enumerate() {
            slots[i] = a.slot();
        }
        for (i, p) in ptrs.iter_mut().enumerate().take(args.len()) {
            *p = &mut slots[i] as *mut u64 as *mut c_void;
        }
        if !programmatic {
            // SAFETY: the argument slots outlive the call (the driver copies them at launch).
            return unsafe { result::launch_kernel(f.0, grid, (block, 1, 1), smem, self.cu_stream(), &mut ptrs[..args.len()]) }
                .map_err(|e| device_err("kernel launch", e));
        }
        // SAFETY: a zeroed attribute union is valid; we set the one field the id names.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: smem,
            hStream: self.cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        // SAFETY: config, attr and the argument slots outlive the call (the driver copies them at launch).
        unsafe { sys::cuLaunchKernelEx(&config, f.0, ptrs.as_mut_ptr(), std::ptr::null_mut()) }
            .result()
            .map_err(|e| device_err("kernel launch (programmatic dependent launch)", e))
    }

    /// How many blocks of `f` (with `block` threads and `smem` bytes of dynamic shared memory) fit on one
    /// multiprocessor at once.
    pub fn blocks_per_multiprocessor(&self, f: Func, block: u32, smem: u32) -> Result<usize> {
        // SAFETY: a valid function handle of a loaded module.
        let n = unsafe { result::occupancy::max_active_block_per_multiprocessor(f.0, block as i32, smem as usize) }
            .map_err(|e| device_err("cuOccupancyMaxActiveBlocksPerMultiprocessor", e))?;
        Ok((n.max(1)) as usize)
    }

    /// Most dynamic shared memory one block may opt in to on this device.
    pub fn max_shared_memory_optin(&self) -> Result<usize> {
        let bytes = self
            .ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_err(|e| device_err("reading the shared memory limit", e))?;
        Ok(bytes as usize)
    }

    /// Let `f` use as much dynamic shared memory as the device allows next to its static shared memory (above
    /// 48 KiB a kernel must opt in); returns that many bytes.
    pub fn allow_max_dynamic_shared_memory(&self, f: Func) -> Result<usize> {
        let optin = self.max_shared_memory_optin()?;
        // SAFETY: a valid function handle of a loaded module.
        let fixed = unsafe { result::function::get_function_attribute(f.0, sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES) }
            .map_err(|e| device_err("cuFuncGetAttribute (static shared memory)", e))? as usize;
        let bytes = optin.saturating_sub(fixed);
        let attribute = sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
        // SAFETY: as above.
        unsafe { result::function::set_function_attribute(f.0, attribute, bytes as i32) }
            .map_err(|e| device_err(&format!("cuFuncSetAttribute ({bytes} bytes of dynamic shared memory)"), e))?;
        Ok(bytes)
    }

    /// Zero `bytes` at `ptr`, ordered on the stream (and recorded as a memset node while capturing).
    pub fn zero_async(&self, ptr: u64, bytes: usize) -> Result<()> {
        // SAFETY: callers pass a range inside one of their allocations.
        unsafe { result::memset_d8_async(ptr, 0, bytes, self.cu_stream()) }.map_err(|e| device_err("cuMemsetD8Async", e))
    }

    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(|e| device_err("synchronizing the CUDA stream", e))
    }

    pub fn alloc(&self, bytes: usize) -> Result<DeviceBuffer> {
        DeviceBuffer::new(&self.ctx, bytes)
    }

    /// Asynchronous host-to-device copy on the stream (pageable sources are staged by the driver before it returns).
    pub fn upload<T: Copy>(&self, dst: u64, src: &[T]) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: dst points to at least size_of_val(src) bytes (callers size buffers from the same lengths).
        unsafe { result::memcpy_htod_async(dst, src, self.cu_stream()) }.map_err(|e| device_err("host-to-device copy", e))
    }

    /// Device-to-host copy, then wait for it.
    pub fn download<T: Copy>(&self, dst: &mut [T], src: u64) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        // SAFETY: src holds at least size_of_val(dst) bytes.
        unsafe { result::memcpy_dtoh_async(dst, src, self.cu_stream()) }
            .map_err(|e| device_err("device-to-host copy", e))?;
        self.synchronize()
    }

    pub fn memory_in_use(&self) -> Option<(usize, usize)> {
        self.ctx.mem_get_info().ok().map(|(free, total)| (total - free, total))
    }
}

/// A raw device allocation, freed on drop.
pub struct DeviceBuffer {
    ptr: u64,
    bytes: usize,
    ctx: Arc<CudaContext>,
}

impl DeviceBuffer {
    fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self> {
        ctx.bind_to_thread().map_err(|e| device_err("binding the CUDA context", e))?;
        let bytes = bytes.max(256);
        // SAFETY: plain cuMemAlloc; freed exactly once in Drop.
        let ptr = unsafe { result::malloc_sync(bytes) }.map_err(|e| {
            Error::Device(format!(
                "cannot allocate {:.1} MiB on the GPU ({e:?}); lower kv_cache_tokens or max_batch_size",
                bytes as f64 / (1 << 20) as f64
            ))
        })?;
        Ok(Self { ptr, bytes, ctx: ctx.clone() })
    }

    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn zero(&self) -> Result<()> {
        // SAFETY: the whole allocation.
        unsafe { result::memset_d8_sync(self.ptr, 0, self.bytes) }.map_err(|e| device_err("cuMemsetD8", e))
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by cuMemAlloc in `new`, not freed before.
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}

/// Page-locked host memory, so a copy from it is a true async DMA (graph replays copy metadata from here).
pub struct PinnedBuffer<T: Copy + Default> {
    ptr: *mut T,
    len: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: owned memory, only reached through &self / &mut self.
unsafe impl<T: Copy + Default + Send> Send for PinnedBuffer<T> {}

impl<T: Copy + Default> PinnedBuffer<T> {
    pub fn new(gpu: &Gpu, len: usize) -> Result<Self> {
        gpu.bind()?;
        let len = len.max(1);
        // SAFETY: cuMemAllocHost of len elements, freed in Drop.
        let ptr = unsafe { result::malloc_host(len * std::mem::size_of::<T>(), 0) }
            .map_err(|e| device_err("cuMemAllocHost", e))? as *mut T;
        // SAFETY: freshly allocated, len elements.
        unsafe { std::slice::from_raw_parts_mut(ptr, len) }.fill(T::default());
        Ok(Self { ptr, len, ctx: gpu.ctx.clone() })
    }

    /// Elements allocated (at least one).
    pub fn capacity(&self) -> usize {
        self.len
    }

    pub fn as_slice(&self) -> &[T] {
        // SAFETY: len initialised elements.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [T] {
        // SAFETY: len initialised elements, uniquely borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl<T: Copy + Default> Drop for PinnedBuffer<T> {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by cuMemAllocHost in `new`.
            let _ = unsafe { result::free_host(self.ptr as *mut c_void) };
        }
    }
}

/// Load cuBLAS from where CUDA installs put it when the loader cache does not know it (the H200 image keeps
/// it in /usr/local/cuda/lib64 only). A library already loaded under its soname satisfies cudarc's later
/// dlopen("libcublas.so.13").
pub fn preload_cublas() {
    extern "C" {
        fn dlopen(filename: *const std::ffi::c_char, flag: i32) -> *mut c_void;
    }
    const RTLD_NOW_GLOBAL: i32 = 0x2 | 0x100;
    let mut dirs: Vec<String> = Vec::new();
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Ok(d) = std::env::var(var) {
            dirs.push(format!("{d}/lib64"));
        }
    }
    dirs.push("/usr/local/cuda/lib64".into());
    for dir in dirs {
        for lib in ["libcublasLt.so.13", "libcublas.so.13"] {
            let path = format!("{dir}/{lib}");
            if std::path::Path::new(&path).exists() {
                let c = CString::new(path).unwrap();
                // SAFETY: dlopen of a path; the handle is deliberately kept for the process lifetime.
                unsafe { dlopen(c.as_ptr(), RTLD_NOW_GLOBAL) };
            }
        }
    }
}
