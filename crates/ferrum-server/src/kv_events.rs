//! The prefix cache's events on a ZMQ PUB socket (`--kv-events tcp://*:5557`), in vLLM's
//! format, for routers that route by which replica holds a prompt's blocks (llm-d's KV-cache
//! indexer). Each message is three frames: the topic `kv@<host:port>@<model>`, an 8-byte
//! big-endian sequence number, and a msgpack batch `[timestamp, [event, …]]` whose events
//! are arrays led by their name: `["BlockStored", [hashes…], parent | nil, [token ids…],
//! block_size]`, `["BlockRemoved", [hashes…]]`, `["AllBlocksCleared"]` (msgspec's
//! array-like, tagged encoding with defaults left out, as vLLM writes it). Consecutive stored
//! blocks of one chain go in one `BlockStored`.

use bytes::Bytes;
use ferrum_generate::KvEvent;
use tokio::sync::mpsc;
use zeromq::{Socket, SocketSend, ZmqMessage};

/// Where the engine thread hands a step's events, with its KV block size.
pub type Sender = mpsc::UnboundedSender<(usize, Vec<KvEvent>)>;

/// Binds `endpoint` (ZMQ syntax; `*` for every interface) and publishes each batch sent to
/// the returned channel under `topic`. Call within the tokio runtime.
pub async fn start(endpoint: &str, topic: String) -> Result<Sender, String> {
    let ep = endpoint.replace("://*:", "://0.0.0.0:");
    let mut socket = zeromq::PubSocket::new();
    socket
        .bind(&ep)
        .await
        .map_err(|e| format!("--kv-events {endpoint}: {e}"))?;
    let (tx, mut rx) = mpsc::unbounded_channel::<(usize, Vec<KvEvent>)>();
    tokio::spawn(async move {
        let mut seq: u64 = 0;
        while let Some((block_size, events)) = rx.recv().await {
            let ts = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            let frames = vec![
                Bytes::from(topic.clone().into_bytes()),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                Bytes::from(encode_batch(ts, &events, block_size)),
            ];
            seq += 1;
            let Ok(msg) = ZmqMessage::try_from(frames) else {
                continue;
            };
            if let Err(e) = socket.send(msg).await {
                tracing::warn!("kv events: {e}");
            }
        }
    });
    Ok(tx)
}

/// A batch as msgpack: `[ts, [events…]]`.
pub fn encode_batch(ts: f64, events: &[KvEvent], block_size: usize) -> Vec<u8> {
    let mut groups: Vec<Group> = Vec::new();
    for e in events {
        match (e, groups.last_mut()) {
            // The next block of the chain just stored joins it.
            (
                KvEvent::BlockStored {
                    hash,
                    parent,
                    tokens,
                },
                Some(Group::Stored {
                    hashes, tokens: t, ..
                }),
            ) if hashes.last().copied() == *parent => {
                hashes.push(*hash);
                t.extend_from_slice(tokens);
            }
            (KvEvent::BlockRemoved { hash }, Some(Group::Removed(hashes))) => hashes.push(*hash),
            (
                KvEvent::BlockStored {
                    hash,
                    parent,
                    tokens,
                },
                _,
            ) => groups.push(Group::Stored {
                hashes: vec![*hash],
                parent: *parent,
                tokens: tokens.clone(),
            }),
            (KvEvent::BlockRemoved { hash }, _) => groups.push(Group::Removed(vec![*hash])),
            (KvEvent::AllBlocksCleared, _) => groups.push(Group::Cleared),
        }
    }
    let mut out = Vec::new();
    array(&mut out, 2);
    out.push(0xcb);
    out.extend_from_slice(&ts.to_be_bytes());
    array(&mut out, groups.len());
    for g in &groups {
        match g {
            Group::Stored {
                hashes,
                parent,
                tokens,
            } => {
                array(&mut out, 5);
                string(&mut out, "BlockStored");
                array(&mut out, hashes.len());
                hashes.iter().for_each(|&h| uint(&mut out, h));
                match parent {
                    Some(p) => uint(&mut out, *p),
                    None => out.push(0xc0),
                }
                array(&mut out, tokens.len());
                tokens.iter().for_each(|&t| uint(&mut out, t as u64));
                uint(&mut out, block_size as u64);
            }
            Group::Removed(hashes) => {
                array(&mut out, 2);
                string(&mut out, "BlockRemoved");
                array(&mut out, hashes.len());
                hashes.iter().for_each(|&h| uint(&mut out, h));
            }
            Group::Cleared => {
                array(&mut out, 1);
                string(&mut out, "AllBlocksCleared");
            }
        }
    }
    out
}

enum Group {
    Stored {
        hashes: Vec<u64>,
        parent: Option<u64>,
        tokens: Vec<u32>,
    },
    Removed(Vec<u64>),
    Cleared,
}

fn array(out: &mut Vec<u8>, n: usize) {
    match n {
        0..=15 => out.push(0x90 | n as u8),
        16..=0xffff => {
            out.push(0xdc);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        }
        _ => {
            out.push(0xdd);
            out.extend_from_slice(&(n as u32).to_be_bytes());
        }
    }
}

fn uint(out: &mut Vec<u8>, v: u64) {
    match v {
        0..=0x7f => out.push(v as u8),
        0x80..=0xff => out.extend_from_slice(&[0xcc, v as u8]),
        0x100..=0xffff => {
            out.push(0xcd);
            out.extend_from_slice(&(v as u16).to_be_bytes());
        }
        0x1_0000..=0xffff_ffff => {
            out.push(0xce);
            out.extend_from_slice(&(v as u32).to_be_bytes());
        }
        _ => {
            out.push(0xcf);
            out.extend_from_slice(&v.to_be_bytes());
        }
    }
}

fn string(out: &mut Vec<u8>, s: &str) {
    // Event names are short: a fixstr.
    debug_assert!(s.len() < 32);
    out.push(0xa0 | s.len() as u8);
    out.extend_from_slice(s.as_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chain_is_one_stored_event_and_removals_gather() {
        let ev = [
            KvEvent::AllBlocksCleared,
            KvEvent::BlockStored {
                hash: 1 << 40,
                parent: None,
                tokens: vec![1, 2],
            },
            KvEvent::BlockStored {
                hash: 300,
                parent: Some(1 << 40),
                tokens: vec![3, 200],
            },
            KvEvent::BlockRemoved { hash: 7 },
            KvEvent::BlockRemoved { hash: 8 },
        ];
        let b = encode_batch(0.5, &ev, 2);
        let mut want = vec![0x92, 0xcb];
        want.extend_from_slice(&0.5f64.to_be_bytes());
        want.push(0x93);
        want.push(0x91);
        want.push(0xa0 | 16);
        want.extend_from_slice(b"AllBlocksCleared");
        want.push(0x95);
        want.push(0xab);
        want.extend_from_slice(b"BlockStored");
        want.extend_from_slice(&[0x92, 0xcf]);
        want.extend_from_slice(&(1u64 << 40).to_be_bytes());
        want.extend_from_slice(&[0xcd, 0x01, 0x2c, 0xc0, 0x94, 1, 2, 3, 0xcc, 200, 2]);
        want.push(0x92);
        want.push(0xac);
        want.extend_from_slice(b"BlockRemoved");
        want.extend_from_slice(&[0x92, 7, 8]);
        assert_eq!(b, want);
    }
}
