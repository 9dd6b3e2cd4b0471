//! `ferrum bench MODEL --spec ngram|draft`: speculative decoding against plain decoding on
//! the same prompts, in one process. Each prompt (chat-rendered when the model has a
//! template) is answered greedily with speculation off and on, in alternating rounds after a
//! warm-up of each; reported per prompt are the median decode rates (from the first token to
//! the last), the median of the per-round ratios, the share of drafted tokens kept, and
//! whether the two answers are the same tokens (they must be).

use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Result};
use ferrum_generate::{Engine, EngineConfig, OutputKind, Request, Speculate};

use crate::bench::median;
use crate::device::MakeBackend;
use crate::BackendOpts;

/// The default prompts: two that copy (code to rewrite with one change, a text to quote)
/// and one with nothing to copy.
const CODE: &str = "fn area(w: f64, h: f64) -> f64 {\n    let a = w * h;\n    println!(\"area {}\", a);\n    a\n}\n\nfn perimeter(w: f64, h: f64) -> f64 {\n    let p = 2.0 * (w + h);\n    println!(\"perimeter {}\", p);\n    p\n}";
const TEXT: &str = "The river rises in the hills above the town. In the spring the water is high and fast; in the late summer it is slow, shallow and warm. The old mill stands where the river bends, and the stone bridge crosses it just below.";

fn default_prompts() -> Vec<(String, String)> {
    vec![
        (
            "code edit".into(),
            format!("Rewrite this code, renaming w to width and changing nothing else:\n\n{CODE}"),
        ),
        (
            "quoting summary".into(),
            format!("Summarise this text in two sentences, quoting its words exactly:\n\n{TEXT}"),
        ),
        (
            "free text".into(),
            "Write a short story about a dragon who learns to cook.".into(),
        ),
    ]
}

/// Speculative decoding on or off for one answer: its tokens, decode rate and drafts.
struct Answer {
    tokens: Vec<u32>,
    tok_s: f64,
    drafted: u64,
    accepted: u64,
}

fn answer<B: MakeBackend>(
    e: &mut Engine<B>,
    prompt: &[u32],
    tg: usize,
    speculate: Speculate,
) -> Result<Answer> {
    let before = e.stats();
    let mut req = Request::new(prompt.to_vec(), tg);
    req.speculate = speculate;
    let id = e.add(req)?;
    let (mut tokens, mut first) = (Vec::new(), None);
    loop {
        for o in e.step()? {
            if o.id != id {
                continue;
            }
            match o.kind {
                OutputKind::Token { token, .. } => {
                    first.get_or_insert_with(Instant::now);
                    tokens.push(token);
                }
                OutputKind::Finished { .. } => {
                    let secs = first.map_or(0.0, |t: Instant| t.elapsed().as_secs_f64());
                    let after = e.stats();
                    return Ok(Answer {
                        tok_s: (tokens.len().saturating_sub(1)) as f64 / secs.max(1e-9),
                        tokens,
                        drafted: after.drafted_tokens - before.drafted_tokens,
                        accepted: after.accepted_tokens - before.accepted_tokens,
                    });
                }
            }
        }
    }
}

pub struct SpecBench<'a> {
    pub model: &'a Path,
    pub be: BackendOpts,
    pub spec: &'a crate::SpecArgs,
    pub prompts: &'a [String],
    pub tg: usize,
    pub reps: usize,
    pub json: bool,
}

pub fn run<B: MakeBackend>(b: SpecBench) -> Result<()> {
    let (k, draft) = b.spec.resolve()?;
    if k == 0 {
        bail!("bench --spec: say which drafter (ngram or draft) and --spec-tokens above 0");
    }
    let ctx = 2048;
    let (model, tok) = crate::load::<B>(b.model, Some(ctx), b.be)?;
    let backend = model.decoder.backend().name();
    let config = EngineConfig::for_model(&model.decoder, ctx);
    let mut engine = Engine::new(model, tok, config)?;
    let mode = match &draft {
        Some(d) => {
            crate::attach_draft(&mut engine, d, b.be)?;
            format!("draft model {}", d.display())
        }
        None => "prompt lookup".to_string(),
    };
    let prompts: Vec<(String, String)> = if b.prompts.is_empty() {
        default_prompts()
    } else {
        b.prompts
            .iter()
            .enumerate()
            .map(|(i, p)| (format!("prompt {}", i + 1), p.clone()))
            .collect()
    };
    let mut rows = Vec::new();
    for (name, text) in &prompts {
        let ids = match engine.tokenizer.chat_template() {
            Some(_) => crate::render(
                &engine.tokenizer,
                &[ferrum_tokenizer::Message {
                    role: "user".into(),
                    content: text.clone(),
                }],
                &serde_json::Map::new(),
            )?,
            None => engine.tokenizer.encode(text, true)?,
        };
        let (mut plain, mut spec, mut ratio) = (Vec::new(), Vec::new(), Vec::new());
        let (mut drafted, mut accepted, mut same) = (0, 0, true);
        // Round 0 warms both up (page faults, the prefix cache) and is not counted.
        for round in 0..=b.reps {
            let p = answer(&mut engine, &ids, b.tg, Speculate::Off)?;
            let s = answer(&mut engine, &ids, b.tg, Speculate::Tokens(k))?;
            same &= p.tokens == s.tokens;
            if round > 0 {
                ratio.push(s.tok_s / p.tok_s);
                plain.push(p.tok_s);
                spec.push(s.tok_s);
                drafted += s.drafted;
                accepted += s.accepted;
            }
        }
        rows.push(serde_json::json!({
            "prompt": name,
            "tokens": b.tg,
            "plain_tok_s": median(plain),
            "spec_tok_s": median(spec),
            "ratio": median(ratio),
            "drafted": drafted,
            "accepted": accepted,
            "acceptance": if drafted > 0 { accepted as f64 / drafted as f64 } else { 0.0 },
            "same_tokens": same,
        }));
    }
    if b.json {
        println!(
            "{}",
            serde_json::json!({
                "model": b.model.display().to_string(),
                "backend": backend,
                "drafter": mode,
                "spec_tokens": k,
                "reps": b.reps,
                "prompts": rows,
            })
        );
    } else {
        println!(
            "{} ({backend}), speculative decoding by {mode}, up to {k} tokens a step; \
             medians of {} alternating rounds",
            b.model.display(),
            b.reps
        );
        println!(
            "{:<18} {:>11} {:>11} {:>7} {:>12} same tokens",
            "prompt", "plain tok/s", "spec tok/s", "ratio", "drafts kept"
        );
        for r in &rows {
            println!(
                "{:<18} {:>11.1} {:>11.1} {:>6.2}× {:>5}/{:<6} {}",
                r["prompt"].as_str().unwrap_or(""),
                r["plain_tok_s"].as_f64().unwrap_or(f64::NAN),
                r["spec_tok_s"].as_f64().unwrap_or(f64::NAN),
                r["ratio"].as_f64().unwrap_or(f64::NAN),
                r["accepted"],
                r["drafted"],
                if r["same_tokens"] == true {
                    "yes"
                } else {
                    "NO"
                },
            );
        }
    }
    if rows.iter().any(|r| r["same_tokens"] != true) {
        bail!("speculative decoding changed an answer");
    }
    Ok(())
}
