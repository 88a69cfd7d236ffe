//! cuBLAS bf16 GEMMs (f32 accumulation) for the batch sizes where our GEMV kernels stop paying.

use std::ffi::c_void;

use cudarc::cublas::{result, sys};

use super::device::{device_err, preload_cublas, DeviceBuffer, Gpu};
use crate::error::{Error, Result};

/// cuBLAS allocates nothing during graph capture when it has a workspace of its own.
const WORKSPACE_BYTES: usize = 32 << 20;

pub struct Blas {
    handle: sys::cublasHandle_t,
    _workspace: DeviceBuffer,
}

// SAFETY: the handle is used only under the backend's ownership, from one thread at a time.
unsafe impl Send for Blas {}
unsafe impl Sync for Blas {}

impl Blas {
    pub fn new(gpu: &Gpu) -> Result<Self> {
        preload_cublas();
        // SAFETY: only probes whether the library can be opened.
        if !unsafe { sys::is_culib_present() } {
            return Err(Error::Device(
                "cuBLAS (libcublas.so.13) not found: add its folder (e.g. /usr/local/cuda/lib64) to LD_LIBRARY_PATH \
                 or `pip install nvidia-cublas`"
                    .into(),
            ));
        }
        gpu.bind()?;
        let handle = result::create_handle().map_err(|e| device_err("cublasCreate", e))?;
        let workspace = gpu.alloc(WORKSPACE_BYTES)?;
        // SAFETY: valid handle, stream and workspace that outlive it.
        unsafe {
            result::set_stream(handle, gpu.cu_stream() as sys::cudaStream_t).map_err(|e| device_err("cublasSetStream", e))?;
            sys::cublasSetWorkspace_v2(handle, workspace.ptr() as *mut c_void, WORKSPACE_BYTES)
                .result()
                .map_err(|e| device_err("cublasSetWorkspace", e))?;
        }
        Ok(Self { handle, _workspace: workspace })
    }

    /// Row-major `y[m, n] = x[m, k] · w[n, k]ᵀ (+ y when accumulate)`, all bf16 with f32 accumulation. In
    /// cuBLAS's column-major terms that is `yᵀ = w · xᵀ (+ yᵀ)` with `w` read transposed.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_bf16(&self, x: u64, w: u64, y: u64, m: usize, n: usize, k: usize, accumulate: bool) -> Result<()> {
        let (alpha, beta) = (1.0f32, if accumulate { 1.0f32 } else { 0.0f32 });
        // SAFETY: pointers are device buffers sized [m,k], [n,k], [m,n] by the caller.
        unsafe {
            result::gemm_ex(
                self.handle,
                sys::cublasOperation_t::CUBLAS_OP_T,
                sys::cublasOperation_t::CUBLAS_OP_N,
                n as i32,
                m as i32,
                k as i32,
                &alpha as *const f32 as *const c_void,
                w as *const c_void,
                sys::cudaDataType::CUDA_R_16BF,
                k as i32,
                x as *const c_void,
                sys::cudaDataType::CUDA_R_16BF,
                k as i32,
                &beta as *const f32 as *const c_void,
                y as *mut c_void,
                sys::cudaDataType::CUDA_R_16BF,
                n as i32,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| device_err("cublasGemmEx (bf16)", e))
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once.
        let _ = unsafe { result::destroy_handle(self.handle) };
    }
}
