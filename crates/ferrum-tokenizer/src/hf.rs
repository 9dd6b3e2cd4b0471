//! A Hugging Face tokenizer folder: `tokenizer.json` does the tokenizing; the files around
//! it say which tokens are BOS / EOS and hold the chat template.
//!
//! Reference: transformers' `PreTrainedTokenizerBase.from_pretrained` and
//! `GenerationConfig`: `tokenizer_config.json` (`bos_token`, `eos_token` as a string or an
//! `{"content": ...}` object, `add_bos_token`, `add_eos_token`, `chat_template` as a string
//! or a list of named templates), `chat_template.jinja` (newer transformers save the
//! template there and it wins), `generation_config.json` (`eos_token_id`, an int or a list).

use std::collections::HashSet;
use std::path::Path;

use ferrum_core::{Error, Result};
use serde_json::Value as Json;

use crate::chat::ChatTemplate;
use crate::Tokenizer;

pub(crate) fn load(dir: &Path) -> Result<Tokenizer> {
    let tok_path = dir.join("tokenizer.json");
    if !tok_path.is_file() {
        return Err(Error::io(
            &tok_path,
            std::io::Error::new(std::io::ErrorKind::NotFound, "no tokenizer.json"),
        ));
    }
    let mut inner = tokenizers::Tokenizer::from_file(&tok_path)
        .map_err(|e| Error::format(&tok_path, format!("cannot load tokenizer: {e}")))?;
    // Embedding models' files often ask for fixed padding and truncation (all-MiniLM's pads
    // every input to 128 tokens): the engine sees every token, so lengths are its business
    // (an input over the context is refused or cut where the request says so).
    inner.with_padding(None);
    inner
        .with_truncation(None)
        .map_err(|e| Error::format(&tok_path, format!("cannot load tokenizer: {e}")))?;

    let config = read_json(&dir.join("tokenizer_config.json"))?.unwrap_or(Json::Null);
    let generation = read_json(&dir.join("generation_config.json"))?.unwrap_or(Json::Null);

    let bos_text = token_text(&config["bos_token"]);
    let eos_text = token_text(&config["eos_token"]);
    let id_of = |text: &Option<String>| text.as_deref().and_then(|t| inner.token_to_id(t));
    let bos_id = id_of(&bos_text);
    let eos_id = id_of(&eos_text);

    // tokenizer.json's post-processor already encodes whether BOS/EOS are added; an
    // explicit add_bos_token / add_eos_token overrides it, as transformers' Llama and Gemma
    // tokenizers do.
    let add_bos = config["add_bos_token"].as_bool();
    let add_eos = config["add_eos_token"].as_bool();
    if add_bos.is_some() || add_eos.is_some() {
        let config_path = dir.join("tokenizer_config.json");
        let pick = |flag: Option<bool>, text: &Option<String>, what: &str| -> Result<_> {
            if flag != Some(true) {
                return Ok(None);
            }
            match text
                .as_deref()
                .and_then(|t| inner.token_to_id(t).map(|id| (id, t)))
            {
                Some((id, t)) => Ok(Some((id, t.to_string()))),
                None => Err(Error::format(
                    &config_path,
                    format!("add_{what}_token is true but {what}_token is missing or unknown"),
                )),
            }
        };
        let bos = pick(add_bos, &bos_text, "bos")?;
        let eos = pick(add_eos, &eos_text, "eos")?;
        let processor = crate::bos_eos_processor(bos, eos)?;
        inner.with_post_processor(processor);
    }

    let mut eos_ids = Vec::new();
    let mut push = |id: u32| {
        if !eos_ids.contains(&id) {
            eos_ids.push(id);
        }
    };
    if let Some(id) = eos_id {
        push(id);
    }
    match &generation["eos_token_id"] {
        Json::Number(n) => n.as_u64().into_iter().for_each(|id| push(id as u32)),
        Json::Array(ids) => ids
            .iter()
            .filter_map(Json::as_u64)
            .for_each(|id| push(id as u32)),
        _ => {}
    }
    crate::add_end_of_turn_ids(&inner, &mut eos_ids);

    let vocab_size = inner.get_vocab_size(true);
    let special: HashSet<u32> = inner
        .get_added_tokens_decoder()
        .into_iter()
        .filter(|(_, t)| t.special)
        .map(|(id, _)| id)
        .collect();
    if let Some(&bad) = eos_ids.iter().find(|&&id| id as usize >= vocab_size) {
        return Err(Error::format(
            dir.join("generation_config.json"),
            format!("eos_token_id {bad} is outside the vocabulary (size {vocab_size})"),
        ));
    }

    let chat_template = match template_source(dir, &config)? {
        Some(src) => Some(ChatTemplate::new(
            &src,
            bos_text.as_deref().unwrap_or_default(),
            eos_text.as_deref().unwrap_or_default(),
        )?),
        None => None,
    };

    Tokenizer::assemble(inner, vocab_size, bos_id, eos_ids, special, chat_template)
}

/// A JSON file's contents, `None` when the file does not exist.
fn read_json(path: &Path) -> Result<Option<Json>> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io(path, e)),
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| Error::format(path, format!("invalid JSON: {e}")))
}

/// `"<s>"` or `{"content": "<s>", ...}` (older transformers' AddedToken form).
fn token_text(v: &Json) -> Option<String> {
    match v {
        Json::String(s) => Some(s.clone()),
        Json::Object(o) => o.get("content").and_then(Json::as_str).map(str::to_string),
        _ => None,
    }
}

fn template_source(dir: &Path, config: &Json) -> Result<Option<String>> {
    let jinja = dir.join("chat_template.jinja");
    match std::fs::read_to_string(&jinja) {
        Ok(src) => return Ok(Some(src)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(Error::io(&jinja, e)),
    }
    let from_config = match &config["chat_template"] {
        Json::String(s) => Some(s.clone()),
        // A list of {"name", "template"}: the one named "default" is what
        // apply_chat_template uses when no name is given.
        Json::Array(list) => list
            .iter()
            .find(|t| t["name"] == "default")
            .and_then(|t| t["template"].as_str())
            .map(str::to_string),
        _ => None,
    };
    if from_config.is_some() {
        return Ok(from_config);
    }
    let json = read_json(&dir.join("chat_template.json"))?;
    Ok(json.and_then(|j| j["chat_template"].as_str().map(str::to_string)))
}
