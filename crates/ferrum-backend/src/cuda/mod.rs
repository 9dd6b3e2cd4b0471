//! The start of a CUDA backend (issue 25), behind the `cuda` feature, off by default: the
//! device probe and the first kernels (`kernels.cu`: RMSNorm, 8-bit activation quantisation,
//! a Q8_0 matrix-vector product on `dp4a`), their PTX built by NVRTC from NVIDIA's PyPI
//! wheels (`scripts/cuda/build-ptx.sh`) and embedded here. The driver library is opened at
//! run time, so the feature builds and its tests run on machines without CUDA, where
//! [`Device::open`] says there is no device.
//!
//! Not yet a [`Backend`](crate::Backend): the kernels are unverified until `tests/cuda.rs` has
//! passed on a device (`scripts/cuda/device-check.sh`).

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use ferrum_core::{Error, Result};

const PTX_SM80: &str = include_str!("ptx/kernels.sm_80.ptx");
const PTX_SM90: &str = include_str!("ptx/kernels.sm_90.ptx");

/// A CUDA device with ferrum's kernels loaded.
pub struct Device {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    name: String,
    capability: (i32, i32),
    rms_norm: CudaFunction,
    quantize_q8: CudaFunction,
    matvec_q8_0: CudaFunction,
}

fn cuda_err(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Unsupported(format!("CUDA: {what}: {e:?}"))
}

impl Device {
    /// Opens device `ordinal`: the driver library (`libcuda`, loaded now, not at build
    /// time), a context, and the PTX for its architecture (sm_90 from compute capability 9,
    /// sm_80 from 8). Errors, never panics, where there is no driver, no such device, or an
    /// older GPU.
    pub fn open(ordinal: usize) -> Result<Device> {
        // SAFETY: only tries to open the library by its usual names.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(Error::Unsupported(
                "no CUDA device: the NVIDIA driver library (libcuda.so) was not found".into(),
            ));
        }
        let count = CudaContext::device_count().map_err(|e| cuda_err("counting devices", e))?;
        if ordinal >= count.max(0) as usize {
            return Err(Error::Unsupported(format!(
                "no CUDA device {ordinal}: the driver reports {count}"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| cuda_err("creating a context", e))?;
        let name = ctx.name().map_err(|e| cuda_err("device name", e))?;
        let capability = ctx
            .compute_capability()
            .map_err(|e| cuda_err("compute capability", e))?;
        let ptx = match capability.0 {
            9.. => PTX_SM90,
            8 => PTX_SM80,
            _ => {
                return Err(Error::Unsupported(format!(
                    "CUDA device {name} has compute capability {}.{}; ferrum's kernels need 8.0 or later",
                    capability.0, capability.1
                )))
            }
        };
        let module = ctx
            .load_module(Ptx::from_src(ptx))
            .map_err(|e| cuda_err("loading the kernels' PTX", e))?;
        let f = |n: &str| {
            module
                .load_function(n)
                .map_err(|e| cuda_err(&format!("kernel {n}"), e))
        };
        Ok(Device {
            stream: ctx.default_stream(),
            rms_norm: f("rms_norm_f32")?,
            quantize_q8: f("quantize_q8_f32")?,
            matvec_q8_0: f("matvec_q8_0")?,
            ctx,
            name,
            capability,
        })
    }

    /// "NVIDIA H200 (sm_90)", for the load line.
    pub fn describe(&self) -> String {
        format!(
            "{} (sm_{}{})",
            self.name, self.capability.0, self.capability.1
        )
    }

    /// RMSNorm of each `width`-long row of `x` times `w`, on the device (host in, host out).
    pub fn rms_norm(&self, x: &[f32], w: &[f32], eps: f32) -> Result<Vec<f32>> {
        let width = w.len();
        assert!(
            width > 0 && x.len().is_multiple_of(width),
            "rows of w.len()"
        );
        let rows = x.len() / width;
        if rows == 0 {
            return Ok(Vec::new());
        }
        let e = |what| move |err| cuda_err(what, err);
        let dx = self.stream.clone_htod(x).map_err(e("upload"))?;
        let dw = self.stream.clone_htod(w).map_err(e("upload"))?;
        let mut out = self
            .stream
            .alloc_zeros::<f32>(x.len())
            .map_err(e("alloc"))?;
        let (width_i, threads) = (width as i32, 256u32);
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut l = self.stream.launch_builder(&self.rms_norm);
        l.arg(&dx).arg(&dw).arg(&mut out).arg(&width_i).arg(&eps);
        // SAFETY: the arguments are the kernel's (pointers to `rows · width`, `width` and
        // `rows · width` floats; the width; epsilon); one block of 256 threads per row.
        unsafe { l.launch(cfg) }.map_err(e("rms_norm_f32"))?;
        self.stream.clone_dtoh(&out).map_err(e("download"))
    }

    /// `out[r] = Σ_k w[r, k] · x[k]` for a Q8_0 matrix in the GGUF layout (`rows` rows of
    /// `x.len()` values), with `x` quantised to 8 bits on the device first, as the CPU's
    /// fast path does.
    pub fn matvec_q8_0(&self, w: &[u8], rows: usize, x: &[f32]) -> Result<Vec<f32>> {
        let k = x.len();
        assert!(k.is_multiple_of(32), "whole blocks of 32");
        let blocks = k / 32;
        assert_eq!(w.len(), rows * blocks * 34, "Q8_0 bytes for rows × k");
        if rows == 0 || blocks == 0 {
            return Ok(vec![0.0; rows]);
        }
        let e = |what| move |err| cuda_err(what, err);
        let s = &self.stream;
        let dx = s.clone_htod(x).map_err(e("upload"))?;
        let dw = s.clone_htod(w).map_err(e("upload"))?;
        let mut q = s.alloc_zeros::<i8>(k).map_err(e("alloc"))?;
        let mut d = s.alloc_zeros::<f32>(blocks).map_err(e("alloc"))?;
        let mut out = s.alloc_zeros::<f32>(rows).map_err(e("alloc"))?;
        // Eight warps a block: one activation block, or one weight row, per warp.
        let per = |n: usize| LaunchConfig {
            grid_dim: (n.div_ceil(8) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let blocks_i = blocks as i32;
        let mut l = s.launch_builder(&self.quantize_q8);
        l.arg(&dx).arg(&mut q).arg(&mut d).arg(&blocks_i);
        // SAFETY: `k` floats in, `k` int8 and `blocks` floats out; a warp per block.
        unsafe { l.launch(per(blocks)) }.map_err(e("quantize_q8_f32"))?;
        let rows_i = rows as i32;
        let mut l = s.launch_builder(&self.matvec_q8_0);
        l.arg(&dw)
            .arg(&q)
            .arg(&d)
            .arg(&mut out)
            .arg(&rows_i)
            .arg(&blocks_i);
        // SAFETY: `rows · blocks` Q8_0 blocks, the quantised activation, `rows` floats out;
        // a warp per row.
        unsafe { l.launch(per(rows)) }.map_err(e("matvec_q8_0"))?;
        s.clone_dtoh(&out).map_err(e("download"))
    }

    /// The context, for the backend to come.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
}
