//! The Vulkan device under the backend: the loader (opened at run time), one compute queue,
//! buffers in device memory, and the one command buffer a forward step records into. Every
//! op is a dispatch recorded with a barrier after it; nothing runs until a read or
//! [`Context::flush`] submits the buffer and waits. Small per-call arrays (token ids, block
//! tables, cos/sin) go through a host-visible staging buffer that is also the path for
//! uploads and reads.
//!
//! A Vulkan error does not panic: it is kept (the first one), every later op is skipped, and
//! [`Context::check`] returns it; the backend's `sync` hands it to the model code.

use ash::vk;
use ferrum_core::{Error, Result};
use std::ffi::CStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// What `ferrum devices` lists and the load line names.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    pub index: usize,
    pub name: String,
    pub kind: &'static str,
    pub driver: String,
    pub api: String,
    /// Bytes of the largest device-local heap.
    pub memory: u64,
    pub subgroup_size: u32,
    pub fp16: bool,
    pub int8: bool,
    pub int_dot: bool,
    pub coop_matrix: bool,
    /// The largest storage-buffer binding: the largest single tensor the device can take.
    pub max_binding: u64,
}

impl DeviceInfo {
    pub fn features(&self) -> String {
        let mut f = vec![format!("subgroup {}", self.subgroup_size)];
        for (on, name) in [
            (self.fp16, "fp16"),
            (self.int8, "int8"),
            (self.int_dot, "int-dot"),
            (self.coop_matrix, "coopmat"),
        ] {
            if on {
                f.push(name.to_string());
            }
        }
        f.join(", ")
    }
}

fn vk_err(what: &str, e: vk::Result) -> Error {
    Error::Device(format!("Vulkan: {what}: {e}"))
}

fn load_entry() -> Result<ash::Entry> {
    // SAFETY: loading the system's Vulkan loader runs its initialisers; nothing else.
    unsafe { ash::Entry::load() }.map_err(|e| {
        Error::Device(format!(
            "no Vulkan loader ({e}); install libvulkan1 and a driver (Mesa's \
             mesa-vulkan-drivers gives the CPU's lavapipe)"
        ))
    })
}

fn create_instance(entry: &ash::Entry) -> Result<ash::Instance> {
    let app = vk::ApplicationInfo::default()
        .application_name(c"ferrum")
        .api_version(vk::API_VERSION_1_1);
    // MoltenVK (Apple) lists its devices only to instances that ask for portability.
    // SAFETY: plain queries and creation with valid structures.
    let exts = unsafe { entry.enumerate_instance_extension_properties(None) }
        .map_err(|e| vk_err("listing instance extensions", e))?;
    let portability = exts.iter().any(|e| {
        e.extension_name_as_c_str()
            .is_ok_and(|n| n == ash::khr::portability_enumeration::NAME)
    });
    let names = [ash::khr::portability_enumeration::NAME.as_ptr()];
    let mut info = vk::InstanceCreateInfo::default().application_info(&app);
    if portability {
        info = info
            .enabled_extension_names(&names)
            .flags(vk::InstanceCreateFlags::ENUMERATE_PORTABILITY_KHR);
    }
    // SAFETY: as above.
    unsafe { entry.create_instance(&info, None) }.map_err(|e| match e {
        vk::Result::ERROR_INCOMPATIBLE_DRIVER => no_driver(),
        e => vk_err("creating an instance", e),
    })
}

fn no_driver() -> Error {
    Error::Device(
        "no Vulkan device (the loader found no driver; Mesa's mesa-vulkan-drivers gives the \
         CPU's lavapipe)"
            .into(),
    )
}

fn describe(instance: &ash::Instance, index: usize, pd: vk::PhysicalDevice) -> DeviceInfo {
    // SAFETY: queries on a physical device the instance listed.
    unsafe {
        let mut driver = vk::PhysicalDeviceDriverProperties::default();
        let mut subgroup = vk::PhysicalDeviceSubgroupProperties::default();
        let mut props2 = vk::PhysicalDeviceProperties2::default()
            .push_next(&mut driver)
            .push_next(&mut subgroup);
        instance.get_physical_device_properties2(pd, &mut props2);
        let props = props2.properties;
        let mut f12 = vk::PhysicalDeviceVulkan12Features::default();
        let mut f2 = vk::PhysicalDeviceFeatures2::default().push_next(&mut f12);
        instance.get_physical_device_features2(pd, &mut f2);
        let exts = instance
            .enumerate_device_extension_properties(pd)
            .unwrap_or_default();
        let has = |n: &CStr| exts.iter().any(|e| e.extension_name_as_c_str() == Ok(n));
        let mem = instance.get_physical_device_memory_properties(pd);
        let memory = mem.memory_heaps[..mem.memory_heap_count as usize]
            .iter()
            .filter(|h| h.flags.contains(vk::MemoryHeapFlags::DEVICE_LOCAL))
            .map(|h| h.size)
            .max()
            .unwrap_or(0);
        let v = props.api_version;
        DeviceInfo {
            index,
            name: props
                .device_name_as_c_str()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default(),
            kind: match props.device_type {
                vk::PhysicalDeviceType::DISCRETE_GPU => "discrete GPU",
                vk::PhysicalDeviceType::INTEGRATED_GPU => "integrated GPU",
                vk::PhysicalDeviceType::VIRTUAL_GPU => "virtual GPU",
                vk::PhysicalDeviceType::CPU => "CPU",
                _ => "other",
            },
            driver: format!(
                "{} {}",
                driver
                    .driver_name_as_c_str()
                    .map(|s| s.to_string_lossy().into_owned())
                    .unwrap_or_default(),
                driver
                    .driver_info_as_c_str()
                    .map(|s| s.to_string_lossy().into_owned())
                    .unwrap_or_default()
            )
            .trim()
            .to_string(),
            api: format!(
                "{}.{}.{}",
                vk::api_version_major(v),
                vk::api_version_minor(v),
                vk::api_version_patch(v)
            ),
            memory,
            subgroup_size: subgroup.subgroup_size,
            fp16: f12.shader_float16 != 0,
            int8: f12.shader_int8 != 0,
            int_dot: has(ash::khr::shader_integer_dot_product::NAME),
            coop_matrix: has(ash::khr::cooperative_matrix::NAME),
            max_binding: props.limits.max_storage_buffer_range as u64,
        }
    }
}

/// Every Vulkan device the loader sees, in its order (`vulkan:N` picks the N-th).
pub fn list() -> Result<Vec<DeviceInfo>> {
    let entry = load_entry()?;
    let instance = create_instance(&entry)?;
    // SAFETY: the instance is live until destroyed below.
    let out = unsafe { instance.enumerate_physical_devices() }
        .map_err(|e| vk_err("listing devices", e))
        .map(|pds| {
            pds.iter()
                .enumerate()
                .map(|(i, &pd)| describe(&instance, i, pd))
                .collect()
        });
    // SAFETY: nothing made from it outlives it.
    unsafe { instance.destroy_instance(None) };
    out
}

/// The device and what everything made on it shares; dropped last (buffers hold it).
pub(crate) struct Shared {
    _entry: ash::Entry,
    instance: ash::Instance,
    pub device: ash::Device,
    queue: vk::Queue,
    queue_family: u32,
    mem: vk::PhysicalDeviceMemoryProperties,
    pub info: DeviceInfo,
    pub min_align: u64,
    /// Device-local bytes allocated through this context.
    pub used: AtomicU64,
}

impl Drop for Shared {
    fn drop(&mut self) {
        // SAFETY: every object made on the device holds an Arc of this, so all are gone.
        unsafe {
            let _ = self.device.device_wait_idle();
            self.device.destroy_device(None);
            self.instance.destroy_instance(None);
        }
    }
}

impl Shared {
    fn memory_type(&self, bits: u32, want: vk::MemoryPropertyFlags) -> Option<u32> {
        (0..self.mem.memory_type_count).find(|&i| {
            bits & (1 << i) != 0
                && self.mem.memory_types[i as usize]
                    .property_flags
                    .contains(want)
        })
    }
}

/// One buffer and its memory. `mapped` is set for host-visible buffers (staging).
pub(crate) struct RawBuf {
    shared: Arc<Shared>,
    pub buffer: vk::Buffer,
    memory: vk::DeviceMemory,
    pub bytes: u64,
    mapped: *mut u8,
    device_local: bool,
}

// SAFETY: the mapped pointer is only written under the recorder's lock (staging), and Vulkan
// handles may be used from any thread with external synchronisation, which the lock gives.
unsafe impl Send for RawBuf {}
// SAFETY: as above.
unsafe impl Sync for RawBuf {}

impl Drop for RawBuf {
    fn drop(&mut self) {
        // SAFETY: a buffer is dropped only when no recorded command holds it (the recorder
        // keeps an Arc of every buffer in the command buffer until it has finished).
        unsafe {
            self.shared.device.destroy_buffer(self.buffer, None);
            self.shared.device.free_memory(self.memory, None);
        }
        if self.device_local {
            self.shared.used.fetch_sub(self.bytes, Ordering::Relaxed);
        }
    }
}

impl RawBuf {
    fn new(shared: &Arc<Shared>, bytes: u64, host: bool) -> Result<RawBuf> {
        let d = &shared.device;
        let bytes = bytes.max(16).next_multiple_of(16);
        let info = vk::BufferCreateInfo::default()
            .size(bytes)
            .usage(
                vk::BufferUsageFlags::STORAGE_BUFFER
                    | vk::BufferUsageFlags::TRANSFER_SRC
                    | vk::BufferUsageFlags::TRANSFER_DST,
            )
            .sharing_mode(vk::SharingMode::EXCLUSIVE);
        // SAFETY: valid create info; the buffer is destroyed on every error path below.
        let buffer =
            unsafe { d.create_buffer(&info, None) }.map_err(|e| vk_err("creating a buffer", e))?;
        let req = unsafe { d.get_buffer_memory_requirements(buffer) };
        let ty = if host {
            let hv = vk::MemoryPropertyFlags::HOST_VISIBLE | vk::MemoryPropertyFlags::HOST_COHERENT;
            shared
                .memory_type(
                    req.memory_type_bits,
                    hv | vk::MemoryPropertyFlags::HOST_CACHED,
                )
                .or_else(|| shared.memory_type(req.memory_type_bits, hv))
        } else {
            shared
                .memory_type(req.memory_type_bits, vk::MemoryPropertyFlags::DEVICE_LOCAL)
                .or_else(|| shared.memory_type(req.memory_type_bits, Default::default()))
        };
        let Some(ty) = ty else {
            unsafe { d.destroy_buffer(buffer, None) };
            return Err(Error::Device(String::from(
                "Vulkan: no memory type for a storage buffer",
            )));
        };
        let alloc = vk::MemoryAllocateInfo::default()
            .allocation_size(req.size)
            .memory_type_index(ty);
        let memory = match unsafe { d.allocate_memory(&alloc, None) } {
            Ok(m) => m,
            Err(e) => {
                unsafe { d.destroy_buffer(buffer, None) };
                let used = shared.used.load(Ordering::Relaxed);
                return Err(Error::Device(format!(
                    "Vulkan: out of device memory: {:.1} MB asked for with {:.1} MB of {:.1} MB \
                     in use on {} ({e})",
                    bytes as f64 / 1e6,
                    used as f64 / 1e6,
                    shared.info.memory as f64 / 1e6,
                    shared.info.name
                )));
            }
        };
        let cleanup = || unsafe {
            d.destroy_buffer(buffer, None);
            d.free_memory(memory, None);
        };
        if let Err(e) = unsafe { d.bind_buffer_memory(buffer, memory, 0) } {
            cleanup();
            return Err(vk_err("binding buffer memory", e));
        }
        let mapped = if host {
            match unsafe { d.map_memory(memory, 0, vk::WHOLE_SIZE, Default::default()) } {
                Ok(p) => p as *mut u8,
                Err(e) => {
                    cleanup();
                    return Err(vk_err("mapping a staging buffer", e));
                }
            }
        } else {
            shared.used.fetch_add(bytes, Ordering::Relaxed);
            std::ptr::null_mut()
        };
        Ok(RawBuf {
            shared: shared.clone(),
            buffer,
            memory,
            bytes,
            mapped,
            device_local: !host,
        })
    }
}

/// A buffer bound to a dispatch: a device buffer, or bytes the recorder stages.
#[derive(Clone, Copy)]
pub(crate) enum Bind<'a> {
    Buf(&'a Arc<RawBuf>),
    Bytes(&'a [u8]),
}

/// Bytes of an f32/u32 slice, for [`Bind::Bytes`].
pub(crate) fn bytes_of<T: Copy>(v: &[T]) -> &[u8] {
    // SAFETY: f32 and u32 have no padding or invalid bit patterns as bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

const STAGING: u64 = 64 << 20;
const MAX_BINDINGS: usize = 8;
const SETS_PER_POOL: u32 = 4096;

struct Recorder {
    pool: vk::CommandPool,
    cmd: vk::CommandBuffer,
    fence: vk::Fence,
    desc_pool: vk::DescriptorPool,
    sets_left: u32,
    recording: bool,
    staging: Arc<RawBuf>,
    cursor: u64,
    /// Buffers the recorded commands use, kept alive until they have run.
    keep: Vec<Arc<RawBuf>>,
    pipelines: Vec<Option<(vk::Pipeline, usize)>>,
    /// `FERRUM_VULKAN_PROFILE=1`: each dispatch runs alone and its seconds and count are
    /// summed per shader, printed when the context is dropped.
    profile: Option<Vec<(f64, u64)>>,
}

pub(crate) struct Context {
    pub shared: Arc<Shared>,
    set_layouts: Vec<vk::DescriptorSetLayout>,
    pipe_layouts: Vec<vk::PipelineLayout>,
    rec: Mutex<Recorder>,
    error: Mutex<Option<String>>,
    shaders: &'static [(&'static str, &'static [u8])],
    /// `FERRUM_VULKAN_FAIL_AFTER=N`: the N+1-th dispatch fails as a lost device would
    /// (fault injection for the server's tests).
    fail_after: Option<u64>,
    dispatches: AtomicU64,
    /// A matmul's threads per weight row (specialisation constant 0): 16 on GPUs, 1 on CPU
    /// devices; `FERRUM_VULKAN_TPR` (1, 2, 4, …, 64) overrides it.
    pub tpr: u32,
}

impl Drop for Context {
    fn drop(&mut self) {
        let d = &self.shared.device;
        let r = self.rec.get_mut().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = &r.profile {
            let total: f64 = p.iter().map(|x| x.0).sum();
            let mut rows: Vec<_> = p
                .iter()
                .zip(self.shaders)
                .filter(|(x, _)| x.1 > 0)
                .collect();
            rows.sort_by(|a, b| b.0 .0.total_cmp(&a.0 .0));
            for ((secs, n), (name, _)) in rows {
                eprintln!(
                    "vulkan profile: {name:<16} {n:>8} dispatches {secs:>9.3} s {:>5.1}%",
                    100.0 * secs / total.max(1e-9)
                );
            }
        }
        // SAFETY: waits for the queue, then destroys what this context made.
        unsafe {
            let _ = d.device_wait_idle();
            r.keep.clear();
            for (p, _) in r.pipelines.iter().flatten() {
                d.destroy_pipeline(*p, None);
            }
            d.destroy_descriptor_pool(r.desc_pool, None);
            d.destroy_fence(r.fence, None);
            d.destroy_command_pool(r.pool, None);
            for &l in &self.pipe_layouts {
                d.destroy_pipeline_layout(l, None);
            }
            for &l in &self.set_layouts {
                d.destroy_descriptor_set_layout(l, None);
            }
        }
    }
}

fn make_desc_pool(d: &ash::Device) -> Result<vk::DescriptorPool> {
    let sizes = [vk::DescriptorPoolSize {
        ty: vk::DescriptorType::STORAGE_BUFFER,
        descriptor_count: SETS_PER_POOL * MAX_BINDINGS as u32,
    }];
    let info = vk::DescriptorPoolCreateInfo::default()
        .max_sets(SETS_PER_POOL)
        .pool_sizes(&sizes);
    // SAFETY: valid create info.
    unsafe { d.create_descriptor_pool(&info, None) }
        .map_err(|e| vk_err("creating a descriptor pool", e))
}

impl Context {
    /// Opens device `index` (the first with a compute queue when `None`, preferring a
    /// discrete GPU, then an integrated one, then anything).
    pub fn new(
        index: Option<usize>,
        shaders: &'static [(&'static str, &'static [u8])],
    ) -> Result<Context> {
        let entry = load_entry()?;
        let instance = create_instance(&entry)?;
        match Self::open(&entry, &instance, index) {
            Ok((pd, info, device, queue_family)) => {
                // SAFETY: queue 0 of the family the device was created with.
                let queue = unsafe { device.get_device_queue(queue_family, 0) };
                let mem = unsafe { instance.get_physical_device_memory_properties(pd) };
                let props = unsafe { instance.get_physical_device_properties(pd) };
                let shared = Arc::new(Shared {
                    _entry: entry,
                    instance,
                    device,
                    queue,
                    queue_family,
                    mem,
                    info,
                    min_align: props.limits.min_storage_buffer_offset_alignment.max(4),
                    used: AtomicU64::new(0),
                });
                Self::with_shared(shared, shaders)
            }
            Err(e) => {
                // SAFETY: nothing else was made from the instance.
                unsafe { instance.destroy_instance(None) };
                Err(e)
            }
        }
    }

    fn open(
        _entry: &ash::Entry,
        instance: &ash::Instance,
        index: Option<usize>,
    ) -> Result<(vk::PhysicalDevice, DeviceInfo, ash::Device, u32)> {
        // SAFETY: queries and device creation with valid structures.
        let pds = unsafe { instance.enumerate_physical_devices() }
            .map_err(|e| vk_err("listing devices", e))?;
        if pds.is_empty() {
            return Err(no_driver());
        }
        let compute_family = |pd: vk::PhysicalDevice| {
            let fams = unsafe { instance.get_physical_device_queue_family_properties(pd) };
            fams.iter()
                .position(|f| f.queue_flags.contains(vk::QueueFlags::COMPUTE))
                .map(|i| i as u32)
        };
        let rank = |pd: vk::PhysicalDevice| {
            let t = unsafe { instance.get_physical_device_properties(pd) }.device_type;
            match t {
                vk::PhysicalDeviceType::DISCRETE_GPU => 0,
                vk::PhysicalDeviceType::INTEGRATED_GPU => 1,
                vk::PhysicalDeviceType::VIRTUAL_GPU => 2,
                _ => 3,
            }
        };
        let i = match index {
            Some(i) if i < pds.len() => i,
            Some(i) => {
                return Err(Error::Device(format!(
                    "no Vulkan device {i}: there are {} (see `ferrum devices`)",
                    pds.len()
                )))
            }
            None => (0..pds.len())
                .filter(|&i| compute_family(pds[i]).is_some())
                .min_by_key(|&i| rank(pds[i]))
                .ok_or_else(|| {
                    Error::Device(String::from("no Vulkan device has a compute queue"))
                })?,
        };
        let pd = pds[i];
        let family = compute_family(pd)
            .ok_or_else(|| Error::Device(format!("Vulkan device {i} has no compute queue")))?;
        let info = describe(instance, i, pd);
        let prio = [1.0f32];
        let queues = [vk::DeviceQueueCreateInfo::default()
            .queue_family_index(family)
            .queue_priorities(&prio)];
        let dinfo = vk::DeviceCreateInfo::default().queue_create_infos(&queues);
        let device = unsafe { instance.create_device(pd, &dinfo, None) }
            .map_err(|e| vk_err("creating the device", e))?;
        Ok((pd, info, device, family))
    }

    fn with_shared(
        shared: Arc<Shared>,
        shaders: &'static [(&'static str, &'static [u8])],
    ) -> Result<Context> {
        let d = &shared.device;
        let mut set_layouts = Vec::new();
        let mut pipe_layouts = Vec::new();
        let range = [vk::PushConstantRange {
            stage_flags: vk::ShaderStageFlags::COMPUTE,
            offset: 0,
            size: 128,
        }];
        for n in 1..=MAX_BINDINGS {
            let binds: Vec<_> = (0..n as u32)
                .map(|b| {
                    vk::DescriptorSetLayoutBinding::default()
                        .binding(b)
                        .descriptor_type(vk::DescriptorType::STORAGE_BUFFER)
                        .descriptor_count(1)
                        .stage_flags(vk::ShaderStageFlags::COMPUTE)
                })
                .collect();
            let info = vk::DescriptorSetLayoutCreateInfo::default().bindings(&binds);
            // SAFETY: valid create infos; destroyed in Drop.
            let sl = unsafe { d.create_descriptor_set_layout(&info, None) }
                .map_err(|e| vk_err("creating a descriptor set layout", e))?;
            set_layouts.push(sl);
            let sls = [sl];
            let info = vk::PipelineLayoutCreateInfo::default()
                .set_layouts(&sls)
                .push_constant_ranges(&range);
            let pl = unsafe { d.create_pipeline_layout(&info, None) }
                .map_err(|e| vk_err("creating a pipeline layout", e))?;
            pipe_layouts.push(pl);
        }
        let pool_info =
            vk::CommandPoolCreateInfo::default().queue_family_index(shared.queue_family);
        let pool = unsafe { d.create_command_pool(&pool_info, None) }
            .map_err(|e| vk_err("creating a command pool", e))?;
        let alloc = vk::CommandBufferAllocateInfo::default()
            .command_pool(pool)
            .level(vk::CommandBufferLevel::PRIMARY)
            .command_buffer_count(1);
        let cmd = unsafe { d.allocate_command_buffers(&alloc) }
            .map_err(|e| vk_err("allocating a command buffer", e))?[0];
        let fence = unsafe { d.create_fence(&vk::FenceCreateInfo::default(), None) }
            .map_err(|e| vk_err("creating a fence", e))?;
        let desc_pool = make_desc_pool(d)?;
        let staging = Arc::new(RawBuf::new(&shared, STAGING, true)?);
        Ok(Context {
            set_layouts,
            pipe_layouts,
            rec: Mutex::new(Recorder {
                pool,
                cmd,
                fence,
                desc_pool,
                sets_left: SETS_PER_POOL,
                recording: false,
                staging,
                cursor: 0,
                keep: Vec::new(),
                pipelines: vec![None; shaders.len()],
                profile: (std::env::var("FERRUM_VULKAN_PROFILE").as_deref() == Ok("1"))
                    .then(|| vec![(0.0, 0); shaders.len()]),
            }),
            error: Mutex::new(None),
            shaders,
            fail_after: std::env::var("FERRUM_VULKAN_FAIL_AFTER")
                .ok()
                .and_then(|v| v.parse().ok()),
            dispatches: AtomicU64::new(0),
            tpr: std::env::var("FERRUM_VULKAN_TPR")
                .ok()
                .and_then(|v| v.parse::<u32>().ok())
                .filter(|t| t.is_power_of_two() && *t <= 64)
                .unwrap_or(if shared.info.kind == "CPU" { 1 } else { 16 }),
            shared,
        })
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.shared.info
    }

    fn lock(&self) -> MutexGuard<'_, Recorder> {
        self.rec.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Keeps the first error; ops after it are skipped.
    pub fn fail(&self, e: impl std::fmt::Display) {
        let mut g = self.error.lock().unwrap_or_else(|e| e.into_inner());
        if g.is_none() {
            *g = Some(e.to_string());
        }
    }

    pub fn failed(&self) -> bool {
        self.error
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    /// Runs what is recorded and reports the first error since the context was made.
    pub fn check(&self) -> Result<()> {
        if !self.failed() {
            let mut r = self.lock();
            if let Err(e) = self.submit(&mut r) {
                self.fail(e);
            }
        }
        match &*self.error.lock().unwrap_or_else(|e| e.into_inner()) {
            Some(e) => Err(Error::Device(format!(
                "GPU ({}): {e}",
                self.shared.info.name
            ))),
            None => Ok(()),
        }
    }

    pub fn alloc(&self, bytes: u64) -> Result<Arc<RawBuf>> {
        if bytes > self.shared.info.max_binding {
            return Err(Error::Device(format!(
                "a {:.1} MB buffer is larger than {} binds ({:.1} MB)",
                bytes as f64 / 1e6,
                self.shared.info.name,
                self.shared.info.max_binding as f64 / 1e6
            )));
        }
        RawBuf::new(&self.shared, bytes, false).map(Arc::new)
    }

    fn begin(&self, r: &mut Recorder) -> Result<()> {
        if !r.recording {
            let info = vk::CommandBufferBeginInfo::default()
                .flags(vk::CommandBufferUsageFlags::ONE_TIME_SUBMIT);
            // SAFETY: the buffer was reset by the last submit (or never used).
            unsafe { self.shared.device.begin_command_buffer(r.cmd, &info) }
                .map_err(|e| vk_err("beginning a command buffer", e))?;
            r.recording = true;
        }
        Ok(())
    }

    /// Submits what is recorded, waits for it, and starts over (staging, descriptors).
    fn submit(&self, r: &mut Recorder) -> Result<()> {
        if !r.recording {
            return Ok(());
        }
        let d = &self.shared.device;
        r.recording = false;
        // SAFETY: the command buffer is in the recording state; the fence is unsignalled.
        let run = unsafe {
            d.end_command_buffer(r.cmd)
                .map_err(|e| vk_err("ending a command buffer", e))?;
            let cmds = [r.cmd];
            let submit = [vk::SubmitInfo::default().command_buffers(&cmds)];
            d.queue_submit(self.shared.queue, &submit, r.fence)
                .map_err(|e| vk_err("submitting", e))?;
            // Ten minutes: a long prefill on a software device is slow, a hung one is lost.
            let waited = d
                .wait_for_fences(&[r.fence], true, 600_000_000_000)
                .map_err(|e| vk_err("waiting for the device", e));
            waited.and_then(|_| {
                d.reset_fences(&[r.fence])
                    .map_err(|e| vk_err("resetting a fence", e))?;
                d.reset_command_pool(r.pool, Default::default())
                    .map_err(|e| vk_err("resetting the command pool", e))?;
                d.reset_descriptor_pool(r.desc_pool, Default::default())
                    .map_err(|e| vk_err("resetting the descriptor pool", e))
            })
        };
        r.sets_left = SETS_PER_POOL;
        r.cursor = 0;
        r.keep.clear();
        run
    }

    fn barrier(&self, r: &Recorder) {
        let mb = [vk::MemoryBarrier::default()
            .src_access_mask(vk::AccessFlags::MEMORY_WRITE)
            .dst_access_mask(vk::AccessFlags::MEMORY_READ | vk::AccessFlags::MEMORY_WRITE)];
        // SAFETY: recording.
        unsafe {
            self.shared.device.cmd_pipeline_barrier(
                r.cmd,
                vk::PipelineStageFlags::COMPUTE_SHADER | vk::PipelineStageFlags::TRANSFER,
                vk::PipelineStageFlags::COMPUTE_SHADER | vk::PipelineStageFlags::TRANSFER,
                Default::default(),
                &mb,
                &[],
                &[],
            )
        }
    }

    /// Room for `bytes` in staging, submitting first if the recorded commands hold too much.
    fn stage(&self, r: &mut Recorder, bytes: u64) -> Result<u64> {
        let a = self.shared.min_align;
        if r.cursor.next_multiple_of(a) + bytes > STAGING {
            self.submit(r)?;
        }
        let at = r.cursor.next_multiple_of(a);
        r.cursor = at + bytes;
        Ok(at)
    }

    fn pipeline(&self, r: &mut Recorder, shader: usize) -> Result<(vk::Pipeline, usize)> {
        if let Some(p) = r.pipelines[shader] {
            return Ok(p);
        }
        let (name, spv) = self.shaders[shader];
        let bindings = spv_bindings(spv)
            .ok_or_else(|| Error::Device(format!("shader {name}: malformed SPIR-V")))?;
        let words: Vec<u32> = spv
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let d = &self.shared.device;
        let info = vk::ShaderModuleCreateInfo::default().code(&words);
        // SAFETY: SPIR-V from our build script; the module is destroyed once the pipeline is.
        let module = unsafe { d.create_shader_module(&info, None) }
            .map_err(|e| vk_err(&format!("loading shader {name}"), e))?;
        let spec_data = self.tpr.to_le_bytes();
        let entries = [vk::SpecializationMapEntry {
            constant_id: 0,
            offset: 0,
            size: 4,
        }];
        let spec = vk::SpecializationInfo::default()
            .map_entries(&entries)
            .data(&spec_data);
        let stage = vk::PipelineShaderStageCreateInfo::default()
            .stage(vk::ShaderStageFlags::COMPUTE)
            .module(module)
            .name(c"main")
            .specialization_info(&spec);
        let ci = [vk::ComputePipelineCreateInfo::default()
            .stage(stage)
            .layout(self.pipe_layouts[bindings - 1])];
        let made = unsafe { d.create_compute_pipelines(vk::PipelineCache::null(), &ci, None) };
        unsafe { d.destroy_shader_module(module, None) };
        let p = made.map_err(|(_, e)| vk_err(&format!("building shader {name}"), e))?[0];
        r.pipelines[shader] = Some((p, bindings));
        Ok((p, bindings))
    }

    /// Records one dispatch of `shader` over `groups` workgroups. A shader's bindings are
    /// `binds` in order; it may declare fewer (extra ones are not bound) but not more.
    pub fn dispatch(&self, shader: usize, binds: &[Bind], push: &[u32], groups: [u32; 3]) {
        if self.failed() || groups.contains(&0) {
            return;
        }
        let n = self.dispatches.fetch_add(1, Ordering::Relaxed);
        if self.fail_after.is_some_and(|f| n >= f) {
            self.fail("device lost (simulated: FERRUM_VULKAN_FAIL_AFTER)");
            return;
        }
        let mut r = self.lock();
        if let Err(e) = self.dispatch_in(&mut r, shader, binds, push, groups) {
            drop(r);
            self.fail(e);
        }
    }

    fn dispatch_in(
        &self,
        r: &mut Recorder,
        shader: usize,
        binds: &[Bind],
        push: &[u32],
        groups: [u32; 3],
    ) -> Result<()> {
        let (pipe, n) = self.pipeline(r, shader)?;
        if r.profile.is_some() {
            self.submit(r)?;
        }
        let t0 = std::time::Instant::now();
        if binds.len() < n {
            return Err(Error::Device(format!(
                "shader {} takes {n} buffers, given {}",
                self.shaders[shader].0,
                binds.len()
            )));
        }
        // Stage every byte array first: staging may submit, which must not happen between
        // allocating this dispatch's descriptor set and recording it.
        let staged: u64 = binds[..n]
            .iter()
            .map(|b| match b {
                Bind::Bytes(v) => (v.len().max(4) as u64).next_multiple_of(self.shared.min_align),
                Bind::Buf(_) => 0,
            })
            .sum();
        if r.sets_left == 0 || r.cursor.next_multiple_of(self.shared.min_align) + staged > STAGING {
            self.submit(r)?;
        }
        let mut infos = Vec::with_capacity(n);
        for b in &binds[..n] {
            infos.push(match b {
                Bind::Buf(buf) => {
                    r.keep.push((*buf).clone());
                    vk::DescriptorBufferInfo {
                        buffer: buf.buffer,
                        offset: 0,
                        range: vk::WHOLE_SIZE,
                    }
                }
                Bind::Bytes(v) => {
                    let len = v.len().max(4) as u64;
                    let at = self.stage(r, len)?;
                    // SAFETY: [at, at + len) lies in the mapped staging buffer, which no
                    // command in flight reads (nothing is in flight while recording).
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            v.as_ptr(),
                            r.staging.mapped.add(at as usize),
                            v.len(),
                        )
                    };
                    vk::DescriptorBufferInfo {
                        buffer: r.staging.buffer,
                        offset: at,
                        range: len,
                    }
                }
            });
        }
        self.begin(r)?;
        let d = &self.shared.device;
        let layouts = [self.set_layouts[n - 1]];
        let ai = vk::DescriptorSetAllocateInfo::default()
            .descriptor_pool(r.desc_pool)
            .set_layouts(&layouts);
        // SAFETY: the pool has room (checked above); the set lives until the pool is reset
        // after the submit that runs this dispatch.
        let set = unsafe { d.allocate_descriptor_sets(&ai) }
            .map_err(|e| vk_err("allocating a descriptor set", e))?[0];
        r.sets_left -= 1;
        let writes: Vec<_> = infos
            .iter()
            .enumerate()
            .map(|(i, info)| {
                vk::WriteDescriptorSet::default()
                    .dst_set(set)
                    .dst_binding(i as u32)
                    .descriptor_type(vk::DescriptorType::STORAGE_BUFFER)
                    .buffer_info(std::slice::from_ref(info))
            })
            .collect();
        let mut pc = [0u32; 32];
        pc[..push.len()].copy_from_slice(push);
        // SAFETY: recording; the pipeline, layout and set are compatible by construction.
        unsafe {
            d.update_descriptor_sets(&writes, &[]);
            d.cmd_bind_pipeline(r.cmd, vk::PipelineBindPoint::COMPUTE, pipe);
            d.cmd_bind_descriptor_sets(
                r.cmd,
                vk::PipelineBindPoint::COMPUTE,
                self.pipe_layouts[n - 1],
                0,
                &[set],
                &[],
            );
            d.cmd_push_constants(
                r.cmd,
                self.pipe_layouts[n - 1],
                vk::ShaderStageFlags::COMPUTE,
                0,
                bytes_of(&pc),
            );
            d.cmd_dispatch(r.cmd, groups[0], groups[1], groups[2]);
        }
        self.barrier(r);
        if r.profile.is_some() {
            self.submit(r)?;
            if let Some(p) = r.profile.as_mut() {
                p[shader].0 += t0.elapsed().as_secs_f64();
                p[shader].1 += 1;
            }
        }
        Ok(())
    }

    /// Copies host bytes into `dst` from byte `at`, through staging (recorded in order with
    /// the dispatches).
    pub fn upload(&self, dst: &Arc<RawBuf>, at: u64, data: &[u8]) {
        if self.failed() {
            return;
        }
        let mut r = self.lock();
        let run = |r: &mut Recorder| -> Result<()> {
            for (i, chunk) in data.chunks((STAGING / 2) as usize).enumerate() {
                let off = self.stage(r, chunk.len() as u64)?;
                // SAFETY: in the mapped staging buffer, not read by anything in flight.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        chunk.as_ptr(),
                        r.staging.mapped.add(off as usize),
                        chunk.len(),
                    )
                };
                self.begin(r)?;
                let region = [vk::BufferCopy {
                    src_offset: off,
                    dst_offset: at + (i as u64) * (STAGING / 2),
                    size: chunk.len() as u64,
                }];
                // SAFETY: recording; both ranges lie in their buffers (checked by callers).
                unsafe {
                    self.shared
                        .device
                        .cmd_copy_buffer(r.cmd, r.staging.buffer, dst.buffer, &region)
                };
                r.keep.push(dst.clone());
                self.barrier(r);
            }
            Ok(())
        };
        if let Err(e) = run(&mut r) {
            drop(r);
            self.fail(e);
        }
    }

    /// Fills `dst` with zeros on the device (recorded in order with the dispatches).
    pub fn zero(&self, dst: &Arc<RawBuf>) {
        if self.failed() {
            return;
        }
        let mut r = self.lock();
        if let Err(e) = self.begin(&mut r) {
            drop(r);
            self.fail(e);
            return;
        }
        // SAFETY: recording; the whole buffer, whose size is a multiple of 4.
        unsafe {
            self.shared
                .device
                .cmd_fill_buffer(r.cmd, dst.buffer, 0, vk::WHOLE_SIZE, 0)
        };
        r.keep.push(dst.clone());
        self.barrier(&r);
    }

    /// Runs everything recorded, then copies `out.len()` bytes of `src` from byte `at`.
    pub fn download(&self, src: &Arc<RawBuf>, at: u64, out: &mut [u8]) {
        if self.failed() {
            return;
        }
        let mut r = self.lock();
        let mut run = |r: &mut Recorder| -> Result<()> {
            for (i, chunk) in out.chunks_mut((STAGING / 2) as usize).enumerate() {
                let off = self.stage(r, chunk.len() as u64)?;
                self.begin(r)?;
                let region = [vk::BufferCopy {
                    src_offset: at + (i as u64) * (STAGING / 2),
                    dst_offset: off,
                    size: chunk.len() as u64,
                }];
                // SAFETY: recording; ranges checked by callers.
                unsafe {
                    self.shared
                        .device
                        .cmd_copy_buffer(r.cmd, src.buffer, r.staging.buffer, &region)
                };
                r.keep.push(src.clone());
                self.submit(r)?;
                // SAFETY: the copy has finished (submit waited); nothing else writes staging.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        r.staging.mapped.add(off as usize),
                        chunk.as_mut_ptr(),
                        chunk.len(),
                    )
                };
            }
            Ok(())
        };
        if let Err(e) = run(&mut r) {
            drop(r);
            self.fail(e);
        }
    }
}

/// How many descriptor bindings a compute shader declares (the largest binding number + 1),
/// read from its SPIR-V decorations: the pipeline layout is chosen by it.
fn spv_bindings(spv: &[u8]) -> Option<usize> {
    if !spv.len().is_multiple_of(4) || spv.len() < 20 {
        return None;
    }
    let w: Vec<u32> = spv
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    if w[0] != 0x0723_0203 {
        return None;
    }
    let (mut i, mut most) = (5, 0);
    while i < w.len() {
        let (len, op) = ((w[i] >> 16) as usize, w[i] & 0xffff);
        if len == 0 || i + len > w.len() {
            return None;
        }
        // OpDecorate %id Binding n
        if op == 71 && len >= 4 && w[i + 2] == 33 {
            most = most.max(w[i + 3] as usize + 1);
        }
        i += len;
    }
    (1..=MAX_BINDINGS).contains(&most).then_some(most)
}
