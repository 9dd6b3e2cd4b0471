//! Counters and histograms for `/metrics` (Prometheus text format), with the vLLM names
//! gateways and dashboards already know.

use std::fmt::Write;
use std::sync::Mutex;

use ferrum_generate::EngineStats;

use crate::worker::ModelCard;

const BUCKETS: [f64; 11] = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0];

#[derive(Default, Clone)]
struct Histogram {
    counts: [u64; BUCKETS.len()],
    count: u64,
    sum: f64,
}

impl Histogram {
    fn observe(&mut self, v: f64) {
        for (c, &b) in self.counts.iter_mut().zip(&BUCKETS) {
            if v <= b {
                *c += 1;
            }
        }
        self.count += 1;
        self.sum += v;
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (c, b) in self.counts.iter().zip(&BUCKETS) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {c}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum {}\n{name}_count {}", self.sum, self.count);
    }
}

#[derive(Default)]
struct Inner {
    requests: u64,
    failed: u64,
    prompt_tokens: u64,
    completion_tokens: u64,
    ttft: Histogram,
    e2e: Histogram,
}

pub struct Metrics {
    inner: Mutex<Inner>,
    /// When the server started (Unix seconds): the LoRA info metric's value, its last change.
    started: f64,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            inner: Mutex::default(),
            started: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64()),
        }
    }
}

impl Metrics {
    pub fn request_done(&self, prompt: usize, completion: usize, ttft: Option<f64>, e2e: f64) {
        if let Ok(mut m) = self.inner.lock() {
            m.requests += 1;
            m.prompt_tokens += prompt as u64;
            m.completion_tokens += completion as u64;
            if let Some(t) = ttft {
                m.ttft.observe(t);
            }
            m.e2e.observe(e2e);
        }
    }

    pub fn request_failed(&self) {
        if let Ok(mut m) = self.inner.lock() {
            m.failed += 1;
        }
    }

    /// The metrics; `card` is the loaded model (none while loading: no cache info yet).
    pub fn render(
        &self,
        s: &EngineStats,
        card: Option<&ModelCard>,
        lora: &crate::worker::LoraTable,
    ) -> String {
        let mut out = String::new();
        let usage = if s.kv_blocks > 0 {
            s.kv_blocks_used as f64 / s.kv_blocks as f64
        } else {
            0.0
        };
        let mut gauge = |name: &str, help: &str, kind: &str, v: f64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}"
            );
        };
        if let Ok(m) = self.inner.lock() {
            gauge(
                "ferrum_requests_total",
                "Requests finished.",
                "counter",
                m.requests as f64,
            );
            gauge(
                "ferrum_requests_failed_total",
                "Requests refused or failed.",
                "counter",
                m.failed as f64,
            );
            gauge(
                "ferrum_prompt_tokens_total",
                "Prompt tokens of finished requests.",
                "counter",
                m.prompt_tokens as f64,
            );
            gauge(
                "ferrum_generation_tokens_total",
                "Tokens generated for finished requests.",
                "counter",
                m.completion_tokens as f64,
            );
        }
        gauge(
            "ferrum_requests_running",
            "Sequences in the running batch.",
            "gauge",
            s.running as f64,
        );
        gauge(
            "ferrum_requests_waiting",
            "Sequences waiting for KV room.",
            "gauge",
            s.waiting as f64,
        );
        gauge(
            "ferrum_kv_cache_usage_ratio",
            "Share of KV blocks referenced.",
            "gauge",
            usage,
        );
        gauge(
            "ferrum_kv_cache_blocks",
            "KV blocks in the pool.",
            "gauge",
            s.kv_blocks as f64,
        );
        gauge(
            "ferrum_spec_draft_tokens_total",
            "Tokens drafted by speculative decoding.",
            "counter",
            s.drafted_tokens as f64,
        );
        gauge(
            "ferrum_spec_accepted_tokens_total",
            "Drafted tokens kept (each the token decoding would have sampled).",
            "counter",
            s.accepted_tokens as f64,
        );
        gauge(
            "ferrum_images_encoded_total",
            "Images run through the vision tower (an image the prefix cache held is not).",
            "counter",
            s.images_encoded as f64,
        );
        gauge(
            "ferrum_spec_acceptance_ratio",
            "Share of drafted tokens kept, since start (0 before any draft).",
            "gauge",
            if s.drafted_tokens > 0 {
                s.accepted_tokens as f64 / s.drafted_tokens as f64
            } else {
                0.0
            },
        );
        // vLLM's names for the same counters, which dashboards and routers read.
        gauge(
            "vllm:spec_decode_num_drafts_total",
            "Drafts checked (one per sequence and step that drafted).",
            "counter",
            s.drafts as f64,
        );
        gauge(
            "vllm:spec_decode_num_draft_tokens_total",
            "Tokens drafted by speculative decoding.",
            "counter",
            s.drafted_tokens as f64,
        );
        gauge(
            "vllm:spec_decode_num_accepted_tokens_total",
            "Drafted tokens kept.",
            "counter",
            s.accepted_tokens as f64,
        );
        gauge(
            "ferrum_prefix_cache_queries_total",
            "Prompt blocks looked up in the prefix cache.",
            "counter",
            s.prefix.queries as f64,
        );
        gauge(
            "ferrum_prefix_cache_hits_total",
            "Prompt blocks found in the prefix cache.",
            "counter",
            s.prefix.hits as f64,
        );
        gauge(
            "ferrum_prefix_cache_tokens_saved_total",
            "Prompt tokens not computed thanks to the prefix cache.",
            "counter",
            s.prefix.tokens_saved as f64,
        );
        gauge(
            "ferrum_prefix_cache_blocks",
            "Distinct blocks the prefix cache can serve (what --kv-events announces).",
            "gauge",
            s.cached_blocks as f64,
        );
        gauge(
            "ferrum_state_snapshots",
            "Hybrid models: recurrent-state snapshots the prefix cache holds (at prompts' block boundaries).",
            "gauge",
            s.states.held as f64,
        );
        gauge(
            "ferrum_state_snapshot_hits_total",
            "Hybrid models: requests that resumed from a recurrent-state snapshot.",
            "counter",
            s.states.hits as f64,
        );
        gauge(
            "ferrum_state_snapshot_evictions_total",
            "Hybrid models: recurrent-state snapshots dropped to make room.",
            "counter",
            s.states.evictions as f64,
        );
        gauge(
            "ferrum_preemptions_total",
            "Sequences preempted for KV room.",
            "counter",
            s.preemptions as f64,
        );
        gauge(
            "vllm:num_requests_running",
            "Number of requests in the running batch.",
            "gauge",
            s.running as f64,
        );
        gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting.",
            "gauge",
            s.waiting as f64,
        );
        gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage; 1 means 100 percent.",
            "gauge",
            usage,
        );
        // The older name, which routers (the inference gateway's endpoint picker) still read.
        gauge(
            "vllm:gpu_cache_usage_perc",
            "KV-cache usage; 1 means 100 percent (the older name of vllm:kv_cache_usage_perc).",
            "gauge",
            usage,
        );
        // vLLM counts prefix-cache queries and hits in tokens.
        gauge(
            "vllm:prefix_cache_queries_total",
            "Prompt tokens looked up in the prefix cache.",
            "counter",
            s.prefix.tokens_queried as f64,
        );
        gauge(
            "vllm:prefix_cache_hits_total",
            "Prompt tokens found in the prefix cache.",
            "counter",
            s.prefix.tokens_saved as f64,
        );
        // Info metrics (value 1, or the last update time): what the KV pool is, and which
        // LoRA adapters run (none: ferrum serves no adapters).
        if let Some(c) = card {
            let _ = writeln!(
                out,
                "# HELP vllm:cache_config_info Information of the KV cache (the block pool).\n\
                 # TYPE vllm:cache_config_info gauge\n\
                 vllm:cache_config_info{{block_size=\"{}\",num_gpu_blocks=\"{}\",\
                 num_cpu_blocks=\"0\",enable_prefix_caching=\"{}\",cache_dtype=\"{}\"}} 1",
                s.block_size, s.kv_blocks, c.prefix_caching, c.kv_dtype
            );
        }
        let _ = writeln!(
            out,
            "# HELP vllm:lora_requests_info Running and waiting LoRA adapters.\n\
             # TYPE vllm:lora_requests_info gauge\n\
             vllm:lora_requests_info{{max_lora=\"{}\",running_lora_adapters=\"{}\",\
             waiting_lora_adapters=\"{}\"}} {}",
            lora.max_loras,
            label(&lora.running.join(",")),
            label(&lora.waiting.join(",")),
            self.started
        );
        if let Ok(m) = self.inner.lock() {
            m.ttft.render(
                &mut out,
                "ferrum_time_to_first_token_seconds",
                "Time to first token.",
            );
            m.e2e.render(
                &mut out,
                "ferrum_request_duration_seconds",
                "Request latency, end to end.",
            );
        }
        out
    }
}

/// A Prometheus label value: backslashes, quotes and newlines escaped (adapter names come
/// from requests).
fn label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}
