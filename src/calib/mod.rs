//! Calibration data: sources (the embedded default mix, `.txt`, `.jsonl` with `text` or chat
//! `messages`, or folders of those), each with a weight, turned into `nsamples` token windows of
//! `seqlen` tokens drawn with a seed. Chat messages are rendered with the model's own
//! `chat_template` through minijinja.

pub mod export;
pub mod token_cache;

use crate::rng::SplitMix64;
use anyhow::{anyhow, bail, Context, Result};
use serde::Serialize;
use sha2::{Digest, Sha256};
use std::path::Path;

/// The default corpus (calibration/SOURCES.md): name, weight, kind, text.
pub const DEFAULT_SOURCES: &[(&str, f64, Kind, &str)] = &[
    (
        "default/wiki",
        0.25,
        Kind::Text,
        include_str!("../../calibration/default/wiki.txt"),
    ),
    (
        "default/web",
        0.15,
        Kind::Text,
        include_str!("../../calibration/default/web.txt"),
    ),
    (
        "default/code",
        0.15,
        Kind::Text,
        include_str!("../../calibration/default/code.txt"),
    ),
    (
        "default/technical",
        0.10,
        Kind::Text,
        include_str!("../../calibration/default/technical.txt"),
    ),
    (
        "default/multilingual",
        0.10,
        Kind::Text,
        include_str!("../../calibration/default/multilingual.txt"),
    ),
    (
        "default/stories",
        0.05,
        Kind::Text,
        include_str!("../../calibration/default/stories.txt"),
    ),
    (
        "default/chat",
        0.20,
        Kind::Jsonl,
        include_str!("../../calibration/default/chat.jsonl"),
    ),
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Text,
    Jsonl,
}

/// One `--calib` argument: `default`, a file or a folder, with an optional `:WEIGHT` suffix.
#[derive(Debug, Clone, PartialEq)]
pub struct CalibSpec {
    pub path: String,
    pub weight: f64,
}

impl CalibSpec {
    pub fn parse(s: &str) -> Result<Self> {
        if let Some((p, w)) = s.rsplit_once(':') {
            if let Ok(weight) = w.parse::<f64>() {
                if !(weight > 0.0 && weight.is_finite()) {
                    bail!("--calib {s}: the weight must be a positive number");
                }
                return Ok(Self {
                    path: p.to_string(),
                    weight,
                });
            }
        }
        Ok(Self {
            path: s.to_string(),
            weight: 1.0,
        })
    }
}

/// The model-specific pieces that turn chat messages into text.
pub struct ChatFormat {
    pub template: Option<String>,
    pub bos_token: String,
    pub eos_token: String,
}

/// Template instructions one conversation may take to render (real chat templates take a few
/// thousand per message).
pub const TEMPLATE_FUEL: u64 = 20_000_000;

impl ChatFormat {
    /// Reads `chat_template` from `chat_template.jinja` or `tokenizer_config.json` in `dir`.
    pub fn from_model_dir(dir: &Path) -> Result<Self> {
        let mut f = ChatFormat {
            template: None,
            bos_token: "<s>".into(),
            eos_token: "</s>".into(),
        };
        let tc = dir.join("tokenizer_config.json");
        if tc.is_file() {
            let text = std::fs::read_to_string(&tc)
                .with_context(|| format!("cannot read {} (it must be UTF-8 text)", tc.display()))?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .with_context(|| format!("{} is not valid JSON", tc.display()))?;
            let tok = |k: &str| -> Option<String> {
                match &v[k] {
                    serde_json::Value::String(s) => Some(s.clone()),
                    o => o["content"].as_str().map(str::to_string),
                }
            };
            if let Some(b) = tok("bos_token") {
                f.bos_token = b;
            }
            if let Some(e) = tok("eos_token") {
                f.eos_token = e;
            }
            f.template = v["chat_template"].as_str().map(str::to_string);
        }
        let jinja = dir.join("chat_template.jinja");
        if jinja.is_file() {
            f.template = Some(std::fs::read_to_string(&jinja).with_context(|| {
                format!("cannot read {} (it must be UTF-8 text)", jinja.display())
            })?);
        }
        Ok(f)
    }

    /// Renders one conversation. Without a template, ChatML (what MiniCPM uses) is written.
    /// Rendering is bounded by [`TEMPLATE_FUEL`].
    pub fn render(&self, messages: &serde_json::Value) -> Result<String> {
        match &self.template {
            Some(t) => {
                let mut env = minijinja::Environment::new();
                // A template is code from the model repo: bound its work, so a loop that never
                // ends (or grows without bound) is an error, not a hang.
                env.set_fuel(Some(TEMPLATE_FUEL));
                env.add_function(
                    "raise_exception",
                    |msg: String| -> std::result::Result<String, minijinja::Error> {
                        Err(minijinja::Error::new(
                            minijinja::ErrorKind::InvalidOperation,
                            msg,
                        ))
                    },
                );
                env.add_template("chat", t)
                    .map_err(|e| anyhow!("cannot parse the model's chat_template: {e}"))?;
                let ctx = minijinja::context! {
                    messages => minijinja::Value::from(minijinja::value::Serde(messages)),
                    bos_token => &self.bos_token,
                    eos_token => &self.eos_token,
                    add_generation_prompt => false,
                };
                env.get_template("chat").unwrap().render(ctx).map_err(|e| {
                    if e.kind() == minijinja::ErrorKind::OutOfFuel {
                        anyhow!(
                            "the model's chat_template did not finish rendering one \
                                 conversation within {TEMPLATE_FUEL} steps (a loop that never \
                                 ends?): fix chat_template, or calibrate on .txt files"
                        )
                    } else {
                        anyhow!("the model's chat_template failed: {e}")
                    }
                })
            }
            None => {
                let mut s = self.bos_token.clone();
                for m in messages.as_array().into_iter().flatten() {
                    s.push_str(&format!(
                        "<|im_start|>{}\n{}<|im_end|>\n",
                        m["role"].as_str().unwrap_or("user"),
                        m["content"].as_str().unwrap_or("")
                    ));
                }
                Ok(s)
            }
        }
    }
}

/// Documents of one source, as text.
fn documents_from(kind: Kind, text: &str, name: &str, chat: &ChatFormat) -> Result<Vec<String>> {
    match kind {
        Kind::Text => Ok(vec![text.to_string()]),
        Kind::Jsonl => {
            let mut docs = vec![];
            for (i, line) in text.lines().enumerate() {
                if line.trim().is_empty() {
                    continue;
                }
                let v: serde_json::Value = serde_json::from_str(line)
                    .with_context(|| format!("{name} line {}: not valid JSON", i + 1))?;
                if let Some(t) = v["text"].as_str() {
                    docs.push(t.to_string());
                } else if v["messages"].is_array() {
                    docs.push(
                        chat.render(&v["messages"])
                            .with_context(|| format!("{name} line {}", i + 1))?,
                    );
                } else {
                    bail!(
                        "{name} line {}: expected an object with \"text\" or \"messages\"",
                        i + 1
                    );
                }
            }
            Ok(docs)
        }
    }
}

/// A named source of documents with its weight.
pub struct Source {
    pub name: String,
    pub weight: f64,
    pub docs: Vec<String>,
}

fn file_source(path: &Path, weight: f64, chat: &ChatFormat) -> Result<Source> {
    let name = path.display().to_string();
    let kind = match path.extension().and_then(|e| e.to_str()) {
        Some("txt") | Some("md") => Kind::Text,
        Some("jsonl") => Kind::Jsonl,
        _ => bail!("--calib {name}: expected a .txt or .jsonl file (or a folder of them)"),
    };
    crate::checkpoint::guard::regular_file(path, "--calib")?;
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read calibration file {name}"))?;
    Ok(Source {
        docs: documents_from(kind, &text, &name, chat)?,
        name,
        weight,
    })
}

/// The model's `tokenizer.json` in `dir`, the one the calibration windows are tokenized with.
pub fn load_tokenizer(dir: &Path) -> Result<tokenizers::Tokenizer> {
    let path = dir.join("tokenizer.json");
    crate::checkpoint::guard::regular_file(&path, "tokenizer")?;
    tokenizers::Tokenizer::from_file(&path)
        .map_err(|e| anyhow!("cannot load {}: {e}", path.display()))
}

/// The `--calib` files and folders (not `default`), as inputs an output may not alias.
pub fn input_paths(specs: &[CalibSpec]) -> Vec<crate::checkpoint::guard::InputPath> {
    specs
        .iter()
        .filter(|c| c.path != "default")
        .map(|c| crate::checkpoint::guard::InputPath::new("--calib", &c.path))
        .collect()
}

/// Expands `--calib` arguments into sources. A folder contributes each .txt/.jsonl file in it
/// (sorted), sharing the folder's weight equally; `default` is the embedded mix.
pub fn load_sources(specs: &[CalibSpec], chat: &ChatFormat) -> Result<Vec<Source>> {
    let mut out = vec![];
    for spec in specs {
        if spec.path == "default" {
            for (name, w, kind, text) in DEFAULT_SOURCES {
                out.push(Source {
                    name: name.to_string(),
                    weight: w * spec.weight,
                    docs: documents_from(*kind, text, name, chat)?,
                });
            }
            continue;
        }
        let p = Path::new(&spec.path);
        if p.is_dir() {
            let mut files: Vec<_> = std::fs::read_dir(p)
                .with_context(|| format!("cannot list --calib folder {}", p.display()))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|f| {
                    f.is_file()
                        && matches!(
                            f.extension().and_then(|e| e.to_str()),
                            Some("txt" | "jsonl")
                        )
                })
                .collect();
            files.sort();
            if files.is_empty() {
                bail!(
                    "--calib folder {} holds no .txt or .jsonl files",
                    p.display()
                );
            }
            let w = spec.weight / files.len() as f64;
            for f in files {
                out.push(file_source(&f, w, chat)?);
            }
        } else if p.is_file() {
            out.push(file_source(p, spec.weight, chat)?);
        } else if p.exists() {
            crate::checkpoint::guard::regular_file(p, "--calib")?;
        } else {
            bail!(
                "--calib {}: no such file or folder (or use `default`)",
                spec.path
            );
        }
    }
    Ok(out)
}

#[derive(Debug, Clone, Serialize)]
pub struct SourceUsage {
    pub name: String,
    pub weight: f64,
    pub tokens_available: usize,
    pub windows: usize,
    pub tokens_used: usize,
}

/// The calibration windows and what went into them.
#[derive(Debug, Clone)]
pub struct CalibSet {
    pub windows: Vec<Vec<u32>>,
    pub usage: Vec<SourceUsage>,
    /// SHA-256 over the token ids of every window, in order.
    pub sha256: String,
}

/// Splits `n` windows over sources by weight (largest remainders, ties to the earlier source).
fn allocate(n: usize, weights: &[f64]) -> Vec<usize> {
    let total: f64 = weights.iter().sum();
    let exact: Vec<f64> = weights.iter().map(|w| n as f64 * w / total).collect();
    let mut alloc: Vec<usize> = exact.iter().map(|x| x.floor() as usize).collect();
    let mut order: Vec<usize> = (0..weights.len()).collect();
    order.sort_by(|&a, &b| {
        (exact[b] - exact[b].floor())
            .total_cmp(&(exact[a] - exact[a].floor()))
            .then(a.cmp(&b))
    });
    let mut left = n - alloc.iter().sum::<usize>();
    for i in order {
        if left == 0 {
            break;
        }
        alloc[i] += 1;
        left -= 1;
    }
    alloc
}

/// The length of each calibration window: one length (`--seqlen 2048`), or lengths drawn
/// log-uniformly between two (`--seqlen 4096..49152`, as long-context calibration runs use), so
/// short and long contexts are both represented without long windows dominating the count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqLen {
    Fixed(usize),
    LogUniform { min: usize, max: usize },
}

impl SeqLen {
    /// The longest window this can draw.
    pub fn max(self) -> usize {
        match self {
            Self::Fixed(n) => n,
            Self::LogUniform { max, .. } => max,
        }
    }

    /// The shortest window this can draw.
    pub fn min(self) -> usize {
        match self {
            Self::Fixed(n) => n,
            Self::LogUniform { min, .. } => min,
        }
    }

    /// The mean length, for estimates before the windows are drawn: `(max − min) / ln(max/min)`
    /// for the log-uniform mix.
    pub fn mean(self) -> f64 {
        match self {
            Self::Fixed(n) => n as f64,
            Self::LogUniform { min, max } if min == max => min as f64,
            Self::LogUniform { min, max } => (max - min) as f64 / (max as f64 / min as f64).ln(),
        }
    }

    /// The length of each of `n` windows, drawn from their own seeded stream (so the window
    /// positions, drawn from another, do not move when only the lengths change).
    pub fn draw(self, n: usize, seed: u64) -> Vec<usize> {
        match self {
            Self::Fixed(len) => vec![len; n],
            Self::LogUniform { min, max } => {
                let mut rng = SplitMix64::new(seed ^ 0x1E46_7415);
                let (lo, hi) = ((min as f64).ln(), (max as f64).ln());
                (0..n)
                    .map(|_| {
                        let l = (lo + (hi - lo) * rng.unit()).exp().round() as usize;
                        l.clamp(min, max)
                    })
                    .collect()
            }
        }
    }
}

impl std::fmt::Display for SeqLen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Fixed(n) => write!(f, "{n}"),
            Self::LogUniform { min, max } => write!(f, "{min}..{max}"),
        }
    }
}

/// A number for one length (as `--seqlen` always recorded it), `"MIN..MAX"` for a mix.
impl Serialize for SeqLen {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        match self {
            Self::Fixed(n) => s.serialize_u64(*n as u64),
            Self::LogUniform { .. } => s.serialize_str(&self.to_string()),
        }
    }
}

impl std::str::FromStr for SeqLen {
    type Err = String;

    /// `N` (at least 2), or `MIN..MAX` with 2 ≤ MIN ≤ MAX.
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let num = |x: &str| -> std::result::Result<usize, String> {
            match x.trim().parse::<usize>() {
                Ok(n) if n >= 2 => Ok(n),
                _ => Err(format!(
                    "{s} is not a window length: use a whole number of tokens of at least 2 \
                     (e.g. 2048), or MIN..MAX for lengths drawn log-uniformly between two \
                     (e.g. 4096..49152)"
                )),
            }
        };
        match s.split_once("..") {
            None => Ok(Self::Fixed(num(s)?)),
            Some((a, b)) => {
                let (min, max) = (num(a)?, num(b)?);
                if min > max {
                    return Err(format!(
                        "{s}: the shortest length {min} is above the longest {max}; write MIN..MAX"
                    ));
                }
                Ok(if min == max {
                    Self::Fixed(min)
                } else {
                    Self::LogUniform { min, max }
                })
            }
        }
    }
}

/// The most tokens one forward batch holds (a longer window is a batch of its own): it bounds
/// the working set of a batch, and it is a constant, so the batches (and the order in which
/// XᵀX sums) do not depend on the machine.
pub const BATCH_TOKENS: usize = 65_536;

/// The forward batches of `windows`: runs of consecutive windows of one length (a batch is one
/// `[B, T]` tensor), at most `batch` windows and [`BATCH_TOKENS`] tokens each (at least one
/// window). With one length of at most `BATCH_TOKENS / batch` tokens this is `chunks(batch)`.
pub fn batch_ranges(windows: &[Vec<u32>], batch: usize) -> Vec<std::ops::Range<usize>> {
    let mut out = vec![];
    let mut start = 0;
    for i in 1..=windows.len() {
        let len = windows[start].len();
        let cap = batch.max(1).min((BATCH_TOKENS / len.max(1)).max(1));
        if i == windows.len() || i - start == cap || windows[i].len() != len {
            out.push(start..i);
            start = i;
        }
    }
    out
}

/// One source's documents as a token stream (documents joined by blank lines, tokenized once).
struct Stream {
    ids: Vec<u32>,
}

/// Tokenizes each source (documents joined by blank lines, one pass) and draws `nsamples`
/// windows whose lengths `lengths` gives, at seeded random positions: windows are split over
/// the sources by weight, and a window lies inside its source's stream where the stream is long
/// enough. A window longer than its source is packed (docs/calibration.md, Long windows): the
/// whole source, then spans of further sources drawn by weight, each as long as the source or
/// what is left to fill, joined by the tokens of a blank line.
pub fn build_windows(
    sources: &[Source],
    tokenizer: &tokenizers::Tokenizer,
    vocab_size: usize,
    nsamples: usize,
    lengths: SeqLen,
    seed: u64,
) -> Result<CalibSet> {
    if nsamples == 0 || lengths.min() < 2 {
        bail!("--nsamples must be at least 1 and --seqlen at least 2");
    }
    let weights: Vec<f64> = sources.iter().map(|s| s.weight).collect();
    let alloc = allocate(nsamples, &weights);
    let tokenize = |text: &str, what: &str| tokenize_checked(tokenizer, vocab_size, text, what);
    let streams = sources
        .iter()
        .map(|src| {
            Ok(Stream {
                ids: tokenize(&src.docs.join("\n\n"), &src.name)?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    check_enough_tokens(sources, &streams, &alloc, lengths)?;
    let separator = tokenize("\n\n", "a blank line")?;
    let window_lengths = lengths.draw(nsamples, seed);
    let mut rng = SplitMix64::new(seed ^ 0x5EED_CA11);
    let draw = Draw {
        streams: &streams,
        weights: &weights,
        separator: &separator,
    };
    let (windows, used) = draw.windows(&alloc, &window_lengths, nsamples, &mut rng);
    let usage = source_usage(sources, &streams, &alloc, &used);
    let sha256 = windows_sha256(&windows);
    Ok(CalibSet {
        windows,
        usage,
        sha256,
    })
}

/// `text` tokenized without special tokens, refused when an id is beyond `vocab_size`; `what`
/// names the text in messages.
fn tokenize_checked(
    tokenizer: &tokenizers::Tokenizer,
    vocab_size: usize,
    text: &str,
    what: &str,
) -> Result<Vec<u32>> {
    let ids =
        token_cache::encode(tokenizer, text).map_err(|e| anyhow!("cannot tokenize {what}: {e}"))?;
    if let Some(bad) = ids.iter().find(|&&i| i as usize >= vocab_size) {
        bail!("tokenizing {what} produced id {bad}, beyond the model's vocab_size {vocab_size}");
    }
    Ok(ids)
}

/// Refuses calibration data shorter than one window of the longest length, and a source that
/// is given windows but has no tokens.
fn check_enough_tokens(
    sources: &[Source],
    streams: &[Stream],
    alloc: &[usize],
    lengths: SeqLen,
) -> Result<()> {
    let total_tokens: usize = streams.iter().map(|s| s.ids.len()).sum();
    if total_tokens < lengths.max() {
        match sources {
            [only] => bail!(
                "calibration source {} has only {total_tokens} tokens, fewer than one window of \
                 --seqlen {}: give more text or a smaller --seqlen",
                only.name,
                lengths.max()
            ),
            _ => bail!(
                "the calibration data holds {total_tokens} tokens in all, fewer than one window \
                 of --seqlen {}: give more text or a smaller --seqlen",
                lengths.max()
            ),
        }
    }
    if let Some((src, _)) = sources
        .iter()
        .zip(streams)
        .zip(alloc)
        .find(|((_, st), &n)| n > 0 && st.ids.is_empty())
        .map(|(x, _)| x)
    {
        bail!(
            "calibration source {} has only 0 tokens: give it text, or leave it out",
            src.name
        );
    }
    Ok(())
}

/// The token streams windows are drawn from, their weights and the tokens of a blank line.
struct Draw<'a> {
    streams: &'a [Stream],
    weights: &'a [f64],
    separator: &'a [u32],
}

impl Draw<'_> {
    /// Draws `alloc[s]` windows from each source `s` in turn, with the lengths `window_lengths`
    /// in order: inside the source's stream where it is long enough, else packed; returns the
    /// windows and each source's tokens used.
    fn windows(
        &self,
        alloc: &[usize],
        window_lengths: &[usize],
        nsamples: usize,
        rng: &mut SplitMix64,
    ) -> (Vec<Vec<u32>>, Vec<usize>) {
        let (streams, weights, separator) = (self.streams, self.weights, self.separator);
        let mut windows = Vec::with_capacity(nsamples);
        let mut used = vec![0usize; streams.len()];
        let mut next = 0;
        for (si, &n) in alloc.iter().enumerate() {
            for _ in 0..n {
                let len = window_lengths[next];
                next += 1;
                let ids = &streams[si].ids;
                if ids.len() >= len {
                    let start = rng.below(ids.len() - len + 1);
                    windows.push(ids[start..start + len].to_vec());
                    used[si] += len;
                    continue;
                }
                windows.push(pack_window(
                    si, len, streams, weights, separator, rng, &mut used,
                ));
            }
        }
        (windows, used)
    }
}

/// How many windows and tokens each source gave.
fn source_usage(
    sources: &[Source],
    streams: &[Stream],
    alloc: &[usize],
    used: &[usize],
) -> Vec<SourceUsage> {
    sources
        .iter()
        .zip(streams)
        .zip(alloc.iter().zip(used))
        .map(|((src, st), (&n, &u))| SourceUsage {
            name: src.name.clone(),
            weight: src.weight,
            tokens_available: st.ids.len(),
            windows: n,
            tokens_used: u,
        })
        .collect()
}

/// The SHA-256 of every window's ids, little-endian u32 in order.
fn windows_sha256(windows: &[Vec<u32>]) -> String {
    let mut h = Sha256::new();
    for w in windows {
        for id in w {
            h.update(id.to_le_bytes());
        }
    }
    crate::checkpoint::manifest::hex(&h.finalize())
}

/// A window of `len` tokens whose source `first` is shorter than it: all of `first`, then
/// spans of sources drawn by weight (sources with no tokens never), each the whole source or the
/// part of the window still empty, at seeded positions, with `separator` between spans. `used`
/// counts each source's tokens taken.
fn pack_window(
    first: usize,
    len: usize,
    streams: &[Stream],
    weights: &[f64],
    separator: &[u32],
    rng: &mut SplitMix64,
    used: &mut [usize],
) -> Vec<u32> {
    let live: Vec<f64> = weights
        .iter()
        .zip(streams)
        .map(|(&w, s)| if s.ids.is_empty() { 0.0 } else { w })
        .collect();
    let total: f64 = live.iter().sum();
    let mut w: Vec<u32> = Vec::with_capacity(len + separator.len());
    let mut src = first;
    while w.len() < len {
        if !w.is_empty() {
            w.extend_from_slice(separator);
            if w.len() >= len {
                break;
            }
            let mut x = rng.unit() * total;
            src = live
                .iter()
                .rposition(|&wt| wt > 0.0)
                .expect("a source has tokens");
            for (i, &wt) in live.iter().enumerate() {
                if wt > 0.0 && x < wt {
                    src = i;
                    break;
                }
                x -= wt;
            }
        }
        let ids = &streams[src].ids;
        let take = (len - w.len()).min(ids.len());
        let start = rng.below(ids.len() - take + 1);
        w.extend_from_slice(&ids[start..start + take]);
        used[src] += take;
    }
    w.truncate(len);
    w
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_weights() {
        assert_eq!(
            CalibSpec::parse("a.txt:0.5").unwrap(),
            CalibSpec {
                path: "a.txt".into(),
                weight: 0.5
            }
        );
        assert_eq!(CalibSpec::parse("default").unwrap().weight, 1.0);
        assert_eq!(CalibSpec::parse("dir/x:y.txt").unwrap().path, "dir/x:y.txt");
        assert!(CalibSpec::parse("a.txt:0").is_err());
    }

    #[test]
    fn batches_hold_one_length_and_a_bounded_number_of_tokens() {
        let w = |n: usize, len: usize| vec![vec![0u32; len]; n];
        let ranges = |ws: &[Vec<u32>], b| batch_ranges(ws, b);
        assert_eq!(ranges(&w(20, 2048), 8), vec![0..8, 8..16, 16..20]);
        assert_eq!(ranges(&w(3, 49_152), 8), vec![0..1, 1..2, 2..3]);
        assert_eq!(ranges(&w(9, 8192), 16), vec![0..8, 8..9]);
        let mut mixed = w(2, 100);
        mixed.extend(w(1, 300));
        mixed.extend(w(2, 100));
        assert_eq!(ranges(&mixed, 8), vec![0..2, 2..3, 3..5]);
        assert!(ranges(&[], 8).is_empty());
    }

    #[test]
    fn log_uniform_lengths_stay_in_range_and_repeat_per_seed() {
        let s: SeqLen = "1000..48000".parse().unwrap();
        let a = s.draw(500, 7);
        assert_eq!(a, s.draw(500, 7));
        assert_ne!(a, s.draw(500, 8));
        assert!(a.iter().all(|&l| (1000..=48000).contains(&l)));
        // Log-uniform: about as many windows below the geometric mean (~6928) as above.
        let below = a.iter().filter(|&&l| l < 6928).count();
        assert!((200..300).contains(&below), "{below}");
        assert_eq!("2048".parse::<SeqLen>().unwrap(), SeqLen::Fixed(2048));
        assert_eq!("512..512".parse::<SeqLen>().unwrap(), SeqLen::Fixed(512));
        for bad in ["0", "1", "9..3", "x", "4..", "..8"] {
            assert!(bad.parse::<SeqLen>().is_err(), "{bad}");
        }
        assert!(
            (SeqLen::LogUniform {
                min: 1000,
                max: 48000
            }
            .mean()
                - 12140.0)
                .abs()
                < 10.0
        );
    }

    #[test]
    fn allocation_is_proportional_and_exact() {
        assert_eq!(allocate(10, &[0.5, 0.5]), vec![5, 5]);
        assert_eq!(allocate(7, &[1.0, 1.0, 1.0]).iter().sum::<usize>(), 7);
        assert_eq!(
            allocate(128, &[0.25, 0.15, 0.15, 0.1, 0.1, 0.05, 0.2]),
            vec![32, 19, 19, 13, 13, 6, 26]
        );
    }

    #[test]
    fn chat_messages_render_with_the_template_or_chatml() {
        let msgs = serde_json::json!([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]);
        let plain = ChatFormat {
            template: None,
            bos_token: "<s>".into(),
            eos_token: "</s>".into(),
        };
        assert_eq!(
            plain.render(&msgs).unwrap(),
            "<s><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
        );
        let t = "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}";
        let f = ChatFormat {
            template: Some(t.into()),
            bos_token: "<s>".into(),
            eos_token: "</s>".into(),
        };
        assert_eq!(f.render(&msgs).unwrap(), "<s>[user]hi[assistant]hello");
    }

    #[test]
    fn a_template_that_never_finishes_is_an_error() {
        let msgs = serde_json::json!([{"role": "user", "content": "hi"}]);
        // 10^15 iterations: runs out of fuel long before, in bounded time and memory.
        let t = "{% for a in range(100000) %}{% for b in range(100000) %}{% for c in \
                 range(100000) %}x{% endfor %}{% endfor %}{% endfor %}";
        let f = ChatFormat {
            template: Some(t.into()),
            bos_token: "<s>".into(),
            eos_token: "</s>".into(),
        };
        let t0 = std::time::Instant::now();
        let e = f.render(&msgs).unwrap_err().to_string();
        assert!(e.contains("did not finish rendering"), "{e}");
        assert!(t0.elapsed().as_secs() < 60);
    }

    #[test]
    fn the_default_mix_has_every_kind_of_text() {
        let chat = ChatFormat {
            template: None,
            bos_token: "<s>".into(),
            eos_token: "</s>".into(),
        };
        let s = load_sources(&[CalibSpec::parse("default").unwrap()], &chat).unwrap();
        assert_eq!(s.len(), 7);
        assert!(
            s.iter().any(|s| s
                .docs
                .iter()
                .any(|d| d.chars().any(|c| ('\u{4e00}'..='\u{9fff}').contains(&c)))),
            "Chinese text"
        );
        assert!(
            s.iter().any(|s| s.docs[0].starts_with("<s><|im_start|>")),
            "chat-formatted text"
        );
        assert!((s.iter().map(|s| s.weight).sum::<f64>() - 1.0).abs() < 1e-9);
    }
}
