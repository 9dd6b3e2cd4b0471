//! `--device`: which backend runs a model (`run`, `serve`, `bench`, `logits`, `perplexity`),
//! and `ferrum devices`. The commands are generic over the backend; [`on_backend!`] picks
//! the instance once, from [`BackendOpts::resolve`].

use anyhow::{bail, Result};
use ferrum_backend::cpu::KvDtype;
use ferrum_backend::vulkan::{self, VulkanBackend};
use ferrum_backend::{Backend, CpuBackend};

/// Where the model runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub(crate) enum Device {
    /// A GPU the Vulkan loader lists, else the CPU. Software devices (lavapipe) are never
    /// picked by `auto`: the CPU backend is far faster on the same cores.
    #[default]
    Auto,
    Cpu,
    /// Vulkan device N (`vulkan:N`), or the first GPU (`vulkan`), or failing that the
    /// first device of any kind.
    Vulkan(Option<usize>),
}

pub(crate) fn parse_device(s: &str) -> std::result::Result<Device, String> {
    match s {
        "auto" => Ok(Device::Auto),
        "cpu" => Ok(Device::Cpu),
        "vulkan" | "gpu" => Ok(Device::Vulkan(None)),
        _ => match s.strip_prefix("vulkan:").map(str::parse::<usize>) {
            Some(Ok(i)) => Ok(Device::Vulkan(Some(i))),
            _ => Err(format!(
                "unknown device {s:?} (auto, cpu, vulkan or vulkan:N; see `ferrum devices`)"
            )),
        },
    }
}

/// How to set up the backend.
#[derive(Clone, Copy, Default)]
pub(crate) struct BackendOpts {
    /// The CPU's f32 activations and KV (the Vulkan backend always works that way).
    pub exact: bool,
    pub kv: Option<KvDtype>,
    pub device: Device,
}

impl BackendOpts {
    /// The options of a command line, resolved.
    pub fn new(exact: bool, kv: Option<KvDtype>, device: Device) -> BackendOpts {
        BackendOpts { exact, kv, device }.resolve()
    }

    /// `auto` made concrete: the first GPU the loader lists, else the CPU. The loader is asked
    /// in a child process (`ferrum devices --first-gpu`): loading the drivers maps tens of
    /// megabytes (lavapipe brings LLVM) that would stay in a process that then runs on the CPU.
    fn resolve(mut self) -> BackendOpts {
        if self.device == Device::Auto {
            let gpu = std::env::current_exe()
                .ok()
                .and_then(|exe| {
                    std::process::Command::new(exe)
                        .args(["devices", "--first-gpu"])
                        .stderr(std::process::Stdio::null())
                        .output()
                        .ok()
                })
                .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok());
            self.device = match gpu {
                Some(i) => Device::Vulkan(Some(i)),
                None => Device::Cpu,
            };
        }
        self
    }

    pub fn on_vulkan(&self) -> bool {
        matches!(self.device, Device::Vulkan(_))
    }
}

/// A backend the commands can make from the options.
pub(crate) trait MakeBackend: Backend + Sized + 'static {
    fn make(o: &BackendOpts) -> Result<Self>;
}

impl MakeBackend for CpuBackend {
    fn make(o: &BackendOpts) -> Result<Self> {
        let b = if o.exact {
            CpuBackend::exact()
        } else {
            CpuBackend::new()
        };
        Ok(match o.kv {
            Some(kv) => b.with_kv(kv),
            None => b,
        })
    }
}

impl MakeBackend for VulkanBackend {
    fn make(o: &BackendOpts) -> Result<Self> {
        if o.kv.is_some_and(|k| k != KvDtype::F32) {
            bail!("the Vulkan backend keeps its KV cache in f32 (--kv-dtype f32 or none)");
        }
        let index = match o.device {
            Device::Vulkan(i) => i,
            _ => None,
        };
        Ok(VulkanBackend::new(index)?)
    }
}

/// Calls the generic function `$f` with the backend type the options resolve to.
macro_rules! on_backend {
    ($opts:expr, $f:ident ( $($arg:expr),* $(,)? )) => {
        if $opts.on_vulkan() {
            $f::<ferrum_backend::vulkan::VulkanBackend>($($arg),*)
        } else {
            $f::<ferrum_backend::CpuBackend>($($arg),*)
        }
    };
}
pub(crate) use on_backend;

/// The index of the first GPU the Vulkan loader lists (not a CPU device such as lavapipe).
fn first_gpu() -> Option<usize> {
    vulkan::list_devices()
        .ok()?
        .into_iter()
        .find(|d| d.kind != "CPU" && d.kind != "other")
        .map(|d| d.index)
}

/// `ferrum devices`: the CPU, then every Vulkan device with its memory, driver and features;
/// with `first`, only the first GPU's index (or nothing), for `auto`.
pub(crate) fn list(first: bool) -> Result<()> {
    if first {
        if let Some(i) = first_gpu() {
            println!("{i}");
        }
        return Ok(());
    }
    println!("cpu       {}", CpuBackend::new().name());
    match vulkan::list_devices() {
        Ok(ds) if ds.is_empty() => println!("vulkan    no devices (the loader found no driver)"),
        Ok(ds) => {
            for d in ds {
                println!(
                    "vulkan:{:<3} {} ({}), {:.1} GB, Vulkan {}, driver {}; {}",
                    d.index,
                    d.name,
                    d.kind,
                    d.memory as f64 / 1e9,
                    d.api,
                    d.driver,
                    d.features()
                );
            }
        }
        Err(e) => println!("vulkan    {e}"),
    }
    Ok(())
}
