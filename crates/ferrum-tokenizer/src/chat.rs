//! Chat templates: a conversation rendered into prompt text with the model's Jinja template.
//!
//! Reference: transformers' `apply_chat_template(..., tokenize=False)`
//! (`transformers/utils/chat_template_utils.py`): a sandboxed jinja2 environment with
//! `trim_blocks` and `lstrip_blocks`, the loop-controls extension, `raise_exception`,
//! `strftime_now`, and a `tojson` filter that is Python's `json.dumps` (non-ASCII kept,
//! `", "` / `": "` separators) rather than jinja2's HTML-safe one. The template sees
//! `messages`, `add_generation_prompt`, `tools` / `documents` (none here), `bos_token` and
//! `eos_token`. minijinja plus minijinja-contrib's Python string/dict methods covers the
//! rest of what published templates use.

use std::fmt::Write as _;
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use ferrum_core::alloc::{Meter, Trip};
use ferrum_core::{Error, Result};
use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, ErrorKind};

const TEMPLATE_NAME: &str = "chat";

/// One turn of a conversation.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Message {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// What one render may use. A chat template is code from the internet: a hostile one must
/// end in an error within a second, not hang the caller or take the machine's memory.
#[derive(Clone, Copy, Debug)]
pub struct RenderLimits {
    /// minijinja instructions (its `fuel`). Published templates use 20-50 per message
    /// (SmolLM2's: 18k for 800 messages; a Qwen3-style one with tool calls: 47k for 900
    /// messages and 50 tools); a loop of loops runs out in about a tenth of a second.
    pub fuel: u64,
    /// Rendered bytes allowed beyond four times the input's size (messages, tools and
    /// variables, as JSON): the prompt is the input plus markup.
    pub max_output: usize,
    /// Heap the render may hold. Enforced where the binary's allocator is
    /// `ferrum_core::alloc::Metered` (`ferrum` and the tests that install it).
    pub max_memory: usize,
    /// Wall-clock time for one render.
    pub timeout: Duration,
}

impl Default for RenderLimits {
    fn default() -> Self {
        RenderLimits {
            fuel: 4_000_000,
            max_output: 4 << 20,
            max_memory: 256 << 20,
            timeout: Duration::from_secs(5),
        }
    }
}

/// A compiled chat template with the BOS/EOS texts it is rendered with.
///
/// Renders run in a sandbox ([`RenderLimits`]) on a thread of their own, so the caller gets
/// an error, not a hang, and at most a few at once. A render stopped at its memory budget
/// leaves its thread behind; the template is then disabled for every clone.
#[derive(Clone)]
pub struct ChatTemplate {
    env: Arc<Environment<'static>>,
    source: String,
    bos_token: String,
    eos_token: String,
    limits: RenderLimits,
    /// Why the template was disabled, once it was.
    disabled: Arc<Mutex<Option<String>>>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source", &self.source)
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .field("limits", &self.limits)
            .finish()
    }
}

impl ChatTemplate {
    /// Compiles `source` with the default [`RenderLimits`]; a syntax error is an
    /// [`Error::Template`].
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<ChatTemplate> {
        Self::with_limits(source, bos_token, eos_token, RenderLimits::default())
    }

    pub fn with_limits(
        source: &str,
        bos_token: &str,
        eos_token: &str,
        limits: RenderLimits,
    ) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        // jinja2's default, which transformers keeps: the template's final newline is dropped.
        env.set_keep_trailing_newline(false);
        env.set_fuel(Some(limits.fuel));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        minijinja_contrib::add_to_environment(&mut env);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| Error::Template(describe(&e)))?;
        warm_up(&env);
        Ok(ChatTemplate {
            env: Arc::new(env),
            source: source.to_string(),
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
            limits,
            disabled: Arc::default(),
        })
    }

    /// Renders the conversation. Errors raised by the template (`raise_exception`) and
    /// runtime errors are [`Error::Template`]; a render past its limits is
    /// [`Error::TemplateLimit`].
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        self.render_with(messages, add_generation_prompt, &serde_json::Map::new())
    }

    /// [`ChatTemplate::render`] with extra template variables (`chat_template_kwargs`, e.g.
    /// `enable_thinking`); they cannot replace the messages or the special-token texts.
    /// Messages may be any serialisable shape (the server passes OpenAI messages with
    /// `tool_calls`); `kwargs` may set `tools`.
    pub fn render_with<M: serde::Serialize>(
        &self,
        messages: &[M],
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String> {
        let (ctx, input_bytes) = self.context(messages, add_generation_prompt, kwargs);
        let cap = self
            .limits
            .max_output
            .saturating_add(input_bytes.saturating_mul(4));
        self.sandboxed(ctx, cap).map_err(|f| f.error)
    }

    /// The template's variables, and the input's size as JSON (for the output cap).
    fn context<M: serde::Serialize>(
        &self,
        messages: &[M],
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> (Value, usize) {
        let input_bytes = serde_json::to_vec(messages).map_or(0, |v| v.len())
            + serde_json::to_vec(kwargs).map_or(0, |v| v.len());
        // Caller's variables first; the conversation and special tokens cannot be replaced.
        let mut vars: std::collections::BTreeMap<String, Value> = Default::default();
        vars.insert("tools".into(), Value::from(()));
        vars.insert("documents".into(), Value::from(()));
        for (k, v) in kwargs {
            vars.insert(k.clone(), Value::from_serialize(v));
        }
        vars.insert("messages".into(), Value::from_serialize(messages));
        vars.insert("add_generation_prompt".into(), add_generation_prompt.into());
        vars.insert("bos_token".into(), Value::from(self.bos_token.as_str()));
        vars.insert("eos_token".into(), Value::from(self.eos_token.as_str()));
        (Value::from_object(vars), input_bytes)
    }

    /// Renders a small sample conversation, as a load-time check: a template that cannot
    /// render even that within its limits is disabled (and the error says why). Errors the
    /// template raises on purpose (a role it does not take) are not its fault here.
    pub fn dry_run(&self) -> Result<()> {
        let sample = [
            Message::new("system", "You are a helpful assistant."),
            Message::new("user", "Hello, how are you?"),
            Message::new("assistant", "I am fine, thank you."),
            Message::new("user", "What is the capital of France?"),
        ];
        let (ctx, _) = self.context(&sample, true, &serde_json::Map::new());
        match self.sandboxed(ctx, self.limits.max_output) {
            // Slow or queued on a busy machine at start-up is not the template's fault.
            Err(f) if !f.transient => match f.error {
                Error::TemplateLimit(m) => {
                    self.disable(&format!("it failed a dry render at load: {m}"));
                    Err(Error::TemplateLimit(m))
                }
                _ => Ok(()),
            },
            _ => Ok(()),
        }
    }

    /// Why renders are refused, once a render went past its memory budget (or the load
    /// check failed).
    pub fn disabled_reason(&self) -> Option<String> {
        self.disabled.lock().ok().and_then(|d| d.clone())
    }

    fn disable(&self, why: &str) {
        disable(&self.disabled, why);
    }

    fn check_enabled(&self) -> std::result::Result<(), Failure> {
        match self.disabled_reason() {
            Some(why) => Err(Failure::of(Error::TemplateLimit(format!(
                "the model's chat template is disabled: {why}"
            )))),
            None => Ok(()),
        }
    }

    /// Runs the render on a thread of its own under the limits; see [`RenderLimits`].
    fn sandboxed(&self, ctx: Value, cap: usize) -> std::result::Result<String, Failure> {
        let limits = self.limits;
        // At most RENDER_SLOTS renders run at once, so renders abandoned at their deadline
        // (they hold their slot until they end) cannot pile up. A render stopped at its memory
        // or stack budget gives its slot back but keeps what it holds (heap up to the budget,
        // touched stack): renders already running when the template is disabled can add to
        // that, so one template can leave at most a few budgets behind.
        self.check_enabled()?;
        let slot = RenderSlot::take(limits.timeout).map_err(Failure::transient)?;
        // A render that waited for its slot may find the template disabled meanwhile.
        self.check_enabled()?;
        // Runaway recursion (a value that contains itself through a namespace, printed) is
        // stopped at its first allocation past 96 MiB of stack (minijinja's deepest legitimate
        // recursion, 500 nested macro calls, needs well under that).
        let meter = Meter::new(limits.max_memory, RENDER_STACK_BUDGET);
        let (tx, rx) = mpsc::sync_channel(1);
        let env = Arc::clone(&self.env);
        let thread_meter = Arc::clone(&meter);
        // A big stack: minijinja recurses natively for nested macro calls (up to its limit
        // of 500), and a stack overflow would abort the process.
        let spawned = std::thread::Builder::new()
            .name("chat-template".into())
            .stack_size(RENDER_STACK)
            .spawn(move || {
                let result = {
                    let _metered = thread_meter.enter();
                    render_capped(&env, ctx, cap)
                };
                // Freed only by a render that ends; one stopped at its budget never does.
                drop(slot);
                let _ = tx.send(result);
            });
        if let Err(e) = spawned {
            return Err(Failure::transient(Error::Template(format!(
                "cannot start the render: {e}"
            ))));
        }
        let deadline = Instant::now() + limits.timeout;
        loop {
            match rx.recv_timeout(Duration::from_millis(5)) {
                Ok(r) => return r.map_err(Failure::of),
                // The thread ended without an answer: it panicked (a bug, not the template's
                // fault as far as we know).
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(Failure::transient(Error::Template(
                        "the render stopped unexpectedly".into(),
                    )))
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
            }
            if let Some(trip) = meter.tripped() {
                // The thread is stopped for good, holding its memory and its slot: give the
                // slot back, and never run this template again.
                RenderSlot::release();
                let why = match trip {
                    Trip::Memory => format!(
                        "a render needed more than {} MiB of memory",
                        limits.max_memory >> 20
                    ),
                    Trip::Stack => "a render recursed without end (a value that contains \
                                    itself?)"
                        .to_string(),
                };
                self.disable(&why);
                return Err(Failure::of(Error::TemplateLimit(why)));
            }
            if Instant::now() >= deadline {
                // Only this request fails: a slow render on a busy machine is not proof of a
                // hostile template. A watcher stays with the render: it gives the slot back if
                // the render trips a budget later, and disables the template if it is still
                // running at four times the deadline (fuel bounds instructions, not their
                // cost: a loop over a 100 MB string can run for hours).
                let disabled = Arc::clone(&self.disabled);
                let _ = std::thread::Builder::new()
                    .name("chat-template-watch".into())
                    .spawn(move || watch_abandoned(rx, meter, disabled, limits.timeout * 3));
                return Err(Failure::transient(Error::TemplateLimit(format!(
                    "a render took longer than {:.1} s",
                    limits.timeout.as_secs_f64()
                ))));
            }
        }
    }

    pub fn source(&self) -> &str {
        &self.source
    }
}

/// Why a sandboxed render failed, and whether that says nothing about the template (a busy
/// machine: no slot, the deadline).
struct Failure {
    error: Error,
    transient: bool,
}

impl Failure {
    fn of(error: Error) -> Failure {
        Failure {
            error,
            transient: false,
        }
    }

    fn transient(error: Error) -> Failure {
        Failure {
            error,
            transient: true,
        }
    }
}

/// Watches a render abandoned at its deadline until it ends; see `sandboxed`.
fn watch_abandoned(
    rx: mpsc::Receiver<Result<String>>,
    meter: Arc<Meter>,
    disabled: Arc<Mutex<Option<String>>>,
    grace: Duration,
) {
    let give_up = Instant::now() + grace;
    let mut flagged = false;
    loop {
        match rx.recv_timeout(Duration::from_millis(20)) {
            Ok(_) | Err(mpsc::RecvTimeoutError::Disconnected) => return,
            Err(mpsc::RecvTimeoutError::Timeout) => {}
        }
        if meter.tripped().is_some() {
            RenderSlot::release();
            disable(&disabled, "a render went over its memory or stack budget");
            return;
        }
        if !flagged && Instant::now() >= give_up {
            flagged = true;
            disable(
                &disabled,
                "a render ran for more than four times its deadline",
            );
        }
    }
}

/// The render thread's stack (address space; only the pages it touches are memory). Big
/// enough that dropping the deepest value fuel lets a template build (a list nested once per
/// instruction, about 70 bytes of stack per level to drop) cannot overflow it: an overflow
/// aborts the process, and dropping recurses without allocating, out of the meter's sight.
const RENDER_STACK: usize = 1 << 30;

/// How deep a render may recurse through allocations before it is stopped.
const RENDER_STACK_BUDGET: usize = 96 << 20;

/// Renders that may run at once (the machines here have two cores; more would only queue).
const RENDER_SLOTS: usize = 4;

static SLOTS: Mutex<usize> = Mutex::new(0);
static SLOT_FREED: std::sync::Condvar = std::sync::Condvar::new();

/// One of the [`RENDER_SLOTS`], held by a running render's thread.
struct RenderSlot;

impl RenderSlot {
    /// Waits up to `wait` for a free slot.
    fn take(wait: Duration) -> Result<RenderSlot> {
        let deadline = Instant::now() + wait;
        let mut used = SLOTS.lock().unwrap_or_else(|e| e.into_inner());
        while *used >= RENDER_SLOTS {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::TemplateLimit(
                    "every chat-template render slot is busy; try again".into(),
                ));
            }
            used = SLOT_FREED
                .wait_timeout(used, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        *used += 1;
        Ok(RenderSlot)
    }

    /// Frees a slot: on drop, and for a thread stopped at its budget, which never drops its
    /// own.
    fn release() {
        let mut used = SLOTS.lock().unwrap_or_else(|e| e.into_inner());
        *used = used.saturating_sub(1);
        SLOT_FREED.notify_one();
    }
}

impl Drop for RenderSlot {
    fn drop(&mut self) {
        Self::release();
    }
}

/// Records why a template is disabled (the first reason stays).
fn disable(cell: &Mutex<Option<String>>, why: &str) {
    if let Ok(mut d) = cell.lock() {
        d.get_or_insert_with(|| why.to_string());
    }
}

/// The render itself, into a buffer that refuses to grow past `cap` bytes.
fn render_capped(env: &Environment<'static>, ctx: Value, cap: usize) -> Result<String> {
    let tmpl = env
        .get_template(TEMPLATE_NAME)
        .map_err(|e| Error::Template(describe(&e)))?;
    let mut out = CappedOutput {
        buf: Vec::new(),
        cap,
        over: false,
    };
    if let Err(e) = tmpl.render_captured_to(ctx, &mut out) {
        if out.over {
            return Err(Error::TemplateLimit(format!(
                "the rendered prompt is longer than {} bytes",
                cap
            )));
        }
        return Err(match e.kind() {
            ErrorKind::OutOfFuel => Error::TemplateLimit(format!(
                "a render ran more than {} template instructions",
                env.fuel().unwrap_or(0)
            )),
            _ if e.to_string().contains("recursion limit") => Error::TemplateLimit(describe(&e)),
            _ => Error::Template(describe(&e)),
        });
    }
    String::from_utf8(out.buf)
        .map_err(|_| Error::Template("the template wrote invalid UTF-8".into()))
}

struct CappedOutput {
    buf: Vec<u8>,
    cap: usize,
    over: bool,
}

impl std::io::Write for CappedOutput {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        if self.buf.len().saturating_add(b.len()) > self.cap {
            self.over = true;
            return Err(std::io::Error::other("the rendered prompt is too long"));
        }
        self.buf.extend_from_slice(b);
        Ok(b.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A render stopped at its memory budget stops wherever it is, and if that is inside a
/// once-only initialisation of a shared cache (minijinja keeps one for the text of small
/// integers), every later user of that cache would wait for good. So the caches a render can
/// reach are filled here, unmetered, before any metered render.
fn warm_up(env: &Environment<'static>) {
    static DONE: std::sync::Once = std::sync::Once::new();
    DONE.call_once(|| {
        let src = "{{ 1 }}{{ 1.5 }}{{ -3 }}{{ [1, 'a'] | tojson }}{{ 'a b' | title }}\
                   {{ range(3) | list | length }}{{ {'k': 1} | items | list }}";
        let _ = env.render_str(src, ());
    });
}

/// minijinja's message plus the reason behind it and where in the template it happened.
fn describe(e: &minijinja::Error) -> String {
    let mut s = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(inner) = source {
        let _ = write!(s, ": {inner}");
        source = inner.source();
    }
    s
}

fn raise_exception(msg: String) -> std::result::Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
}

/// `strftime_now(format)`: the current UTC time in Python `strftime` notation. Only the
/// directives chat templates use are supported; others are an error rather than wrong text.
/// Today's date (UTC) as `YYYY-MM-DD`, as templates write it with `strftime_now`.
pub fn today() -> String {
    strftime_now("%Y-%m-%d".into()).unwrap_or_default()
}

fn strftime_now(format: String) -> std::result::Result<String, minijinja::Error> {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    strftime(secs, &format)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

fn strftime(unix_secs: i64, format: &str) -> std::result::Result<String, minijinja::Error> {
    let days = unix_secs.div_euclid(86_400);
    let secs_of_day = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (secs_of_day / 3600, secs_of_day / 60 % 60, secs_of_day % 60);
    // 1970-01-01 was a Thursday (index 3 with Monday = 0).
    let weekday = (days + 3).rem_euclid(7) as usize;
    let is_leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    const CUMULATIVE: [i64; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let day_of_year = CUMULATIVE[month as usize - 1] + day + i64::from(is_leap && month > 2);
    let hour12 = if hour % 12 == 0 { 12 } else { hour % 12 };

    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let Some(d) = chars.next() else {
            out.push('%');
            break;
        };
        let month_name = MONTHS[month as usize - 1];
        let day_name = WEEKDAYS[weekday];
        match d {
            'Y' => write!(out, "{year}"),
            'y' => write!(out, "{:02}", year.rem_euclid(100)),
            'm' => write!(out, "{month:02}"),
            'd' => write!(out, "{day:02}"),
            'e' => write!(out, "{day:>2}"),
            'H' => write!(out, "{hour:02}"),
            'I' => write!(out, "{hour12:02}"),
            'M' => write!(out, "{minute:02}"),
            'S' => write!(out, "{second:02}"),
            'p' => write!(out, "{}", if hour < 12 { "AM" } else { "PM" }),
            'j' => write!(out, "{day_of_year:03}"),
            'B' => write!(out, "{month_name}"),
            'b' | 'h' => write!(out, "{}", &month_name[..3]),
            'A' => write!(out, "{day_name}"),
            'a' => write!(out, "{}", &day_name[..3]),
            'F' => write!(out, "{year}-{month:02}-{day:02}"),
            'T' => write!(out, "{hour:02}:{minute:02}:{second:02}"),
            '%' => write!(out, "%"),
            other => {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    format!("strftime_now: unsupported directive %{other}"),
                ))
            }
        }
        .expect("writing to a String cannot fail");
    }
    Ok(out)
}

/// Proleptic Gregorian (year, month, day) of a day count since 1970-01-01
/// (Howard Hinnant's `civil_from_days`).
pub fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// Python's `json.dumps(value, ensure_ascii=False, indent=indent, separators=...,
/// sort_keys=...)`, which is what transformers installs as `tojson`.
fn tojson(
    value: Value,
    indent: Option<Value>,
    kwargs: Kwargs,
) -> std::result::Result<String, minijinja::Error> {
    let indent = match kwargs.get::<Option<Value>>("indent")?.or(indent) {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.kind() {
            ValueKind::Number => {
                Some(" ".repeat(usize::try_from(v.as_i64().unwrap_or(0)).unwrap_or(0)))
            }
            ValueKind::String => Some(v.as_str().unwrap_or_default().to_string()),
            _ => {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: indent must be an integer or a string",
                ))
            }
        },
    };
    let (item_sep, key_sep) = match kwargs.get::<Option<Vec<String>>>("separators")? {
        Some(s) if s.len() == 2 => (s[0].clone(), s[1].clone()),
        Some(_) => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be a pair of strings",
            ))
        }
        // Python's defaults: no space before the newline when indenting.
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    let ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
    kwargs.assert_all_used()?;
    let style = JsonStyle {
        indent,
        item_sep,
        key_sep,
        sort_keys,
        ensure_ascii,
    };
    let mut out = String::new();
    style.write(&mut out, &value, 0)?;
    Ok(out)
}

struct JsonStyle {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

impl JsonStyle {
    fn newline(&self, out: &mut String, level: usize) {
        if let Some(ind) = &self.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(ind);
            }
        }
    }

    fn write(
        &self,
        out: &mut String,
        v: &Value,
        level: usize,
    ) -> std::result::Result<(), minijinja::Error> {
        match v.kind() {
            ValueKind::Undefined | ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
            ValueKind::Number => write_number(out, v),
            ValueKind::String => self.write_str(out, v.as_str().unwrap_or_default()),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = v.try_iter()?.collect();
                self.write_container(out, '[', ']', &items, level, |out, item, level| {
                    self.write(out, item, level)
                })?;
            }
            ValueKind::Map => {
                let mut keys: Vec<Value> = v.try_iter()?.collect();
                if self.sort_keys {
                    keys.sort();
                }
                self.write_container(out, '{', '}', &keys, level, |out, key, level| {
                    match key.as_str() {
                        Some(k) => self.write_str(out, k),
                        // Python turns numbers, bools and None into string keys.
                        None => {
                            let mut k = String::new();
                            self.write(&mut k, key, level)?;
                            self.write_str(out, &k);
                        }
                    }
                    out.push_str(&self.key_sep);
                    self.write(out, &v.get_item(key)?, level)
                })?;
            }
            _ => {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson: cannot serialise a value of type {}", v.kind()),
                ))
            }
        }
        Ok(())
    }

    fn write_container(
        &self,
        out: &mut String,
        open: char,
        close: char,
        items: &[Value],
        level: usize,
        mut each: impl FnMut(&mut String, &Value, usize) -> std::result::Result<(), minijinja::Error>,
    ) -> std::result::Result<(), minijinja::Error> {
        out.push(open);
        if items.is_empty() {
            out.push(close);
            return Ok(());
        }
        for (i, item) in items.iter().enumerate() {
            if i > 0 {
                out.push_str(&self.item_sep);
            }
            self.newline(out, level + 1);
            each(out, item, level + 1)?;
        }
        self.newline(out, level);
        out.push(close);
        Ok(())
    }

    fn write_str(&self, out: &mut String, s: &str) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{08}' => out.push_str("\\b"),
                '\u{0C}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 => {
                    let _ = write!(out, "\\u{:04x}", c as u32);
                }
                c if self.ensure_ascii && !c.is_ascii() => {
                    let mut buf = [0u16; 2];
                    for unit in c.encode_utf16(&mut buf) {
                        let _ = write!(out, "\\u{unit:04x}");
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

/// Integers as integers; floats as Python's `repr` (which always shows a fraction or an
/// exponent); NaN and infinities as Python writes them.
fn write_number(out: &mut String, v: &Value) {
    if v.is_integer() {
        // i128 / u128 values that do not fit i64 still print exactly through Display.
        let _ = write!(out, "{v}");
        return;
    }
    let f = f64::try_from(v.clone()).unwrap_or(f64::NAN);
    if f.is_nan() {
        out.push_str("NaN");
    } else if f.is_infinite() {
        out.push_str(if f > 0.0 { "Infinity" } else { "-Infinity" });
    } else {
        // Rust's shortest round-trip repr matches Python's except for the exponent form.
        let _ = write!(out, "{f:?}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msgs(v: &[(&str, &str)]) -> Vec<Message> {
        v.iter().map(|(r, c)| Message::new(*r, *c)).collect()
    }

    #[test]
    fn syntax_error_is_a_template_error() {
        let err = ChatTemplate::new("{% for m in messages %}{{ m.content }}", "", "").unwrap_err();
        assert!(matches!(err, Error::Template(_)), "{err}");
    }

    #[test]
    fn raise_exception_is_a_template_error() {
        let t = ChatTemplate::new(
            "{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}",
            "",
            "",
        )
        .unwrap();
        let err = t.render(&msgs(&[("system", "x")]), false).unwrap_err();
        assert!(
            matches!(&err, Error::Template(m) if m.contains("user first")),
            "{err}"
        );
        assert_eq!(t.render(&msgs(&[("user", "x")]), false).unwrap(), "");
    }

    #[test]
    fn trim_and_lstrip_blocks_like_jinja2() {
        let src = "{{ bos_token }}\n{% for m in messages %}\n    {% if m.role == 'user' %}\n[U]{{ m.content.strip() }}\n    {% endif %}\n{% endfor %}\n{% if add_generation_prompt %}[A]{% endif %}\n";
        let t = ChatTemplate::new(src, "<s>", "</s>").unwrap();
        let out = t.render(&msgs(&[("user", "  hi  ")]), true).unwrap();
        assert_eq!(out, "<s>\n[U]hi\n[A]");
    }

    #[test]
    fn pycompat_methods_and_loop_controls() {
        let src = "{% for m in messages %}{% if m.content.startswith('skip') %}{% continue %}{% endif %}{{ m.role.upper() }}:{{ m.content.split(' ')|length }};{% endfor %}";
        let t = ChatTemplate::new(src, "", "").unwrap();
        let out = t
            .render(
                &msgs(&[("user", "a b c"), ("user", "skip me"), ("bot", "d")]),
                false,
            )
            .unwrap();
        assert_eq!(out, "USER:3;BOT:1;");
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        let t = ChatTemplate::new(
            "{{ messages[0] | tojson }}|{{ {'a': [1, 2.5, none, true], 'é': '<\"x\">'} | tojson }}|{{ [] | tojson(indent=2) }}|{{ {'k': [1]} | tojson(indent=2) }}",
            "",
            "",
        )
        .unwrap();
        let out = t.render(&msgs(&[("user", "hé\n")]), false).unwrap();
        assert_eq!(
            out,
            "{\"role\": \"user\", \"content\": \"hé\\n\"}|{\"a\": [1, 2.5, null, true], \"é\": \"<\\\"x\\\">\"}|[]|{\n  \"k\": [\n    1\n  ]\n}"
        );
    }

    #[test]
    fn strftime_formats_known_dates() {
        // 2024-02-29 13:05:09 UTC, a Thursday.
        let t = 1_709_211_909;
        assert_eq!(
            strftime(t, "%d %b %Y %H:%M:%S %A %j %I%p %%").unwrap(),
            "29 Feb 2024 13:05:09 Thursday 060 01PM %"
        );
        assert_eq!(strftime(0, "%Y-%m-%d %a").unwrap(), "1970-01-01 Thu");
        assert!(strftime(0, "%Q").is_err());
        let t = ChatTemplate::new("{{ strftime_now('%Y') }}", "", "").unwrap();
        assert_eq!(t.render(&[], false).unwrap().len(), 4);
    }
}
