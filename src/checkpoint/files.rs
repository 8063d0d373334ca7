//! Single files of an output: written whole (`write_file`), replaced atomically
//! (`write_atomic`), or copied byte for byte from the source; and which files of a model folder
//! travel with it into every output (the side files: tokenizer, chat template, licence, remote
//! code...).

use anyhow::{Context, Result};
use std::path::{Path, PathBuf};

/// Replaces `path` atomically: `write` fills `<path>.tmp`, which is synced and renamed over
/// `path`, so a crash or a full disk leaves the old file or the new one, never a torn one. For
/// files inside a folder the tool made itself (the journal in `<out>.partial`); a file at a path
/// the user names goes through [`guard::OutputFile`](super::guard::OutputFile) instead.
pub fn write_atomic(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    write(&tmp)
        .and_then(|()| -> Result<()> {
            std::fs::File::open(&tmp)?.sync_all()?;
            Ok(crate::fault::write_point("a temporary file written")?)
        })
        .with_context(|| format!("cannot write {} (disk full?)", tmp.display()))?;
    std::fs::rename(&tmp, path)
        .with_context(|| format!("cannot rename {} to {}", tmp.display(), path.display()))
}

pub fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    crate::fault::write_point("before writing a file")
        .and_then(|()| std::fs::write(path, bytes))
        .with_context(|| format!("cannot write {} (disk full?)", path.display()))
}

/// Copies `names` from `src` into `dst` byte for byte (the tokenizer is never re-serialized:
/// a re-written tokenizer.json served garbage under another transformers version).
pub fn copy_files(src: &Path, dst: &Path, names: &[String]) -> Result<()> {
    for name in names {
        let from = src.join(name);
        crate::fault::write_point("before copying a side file")
            .and_then(|()| std::fs::copy(&from, dst.join(name)))
            .with_context(|| {
                format!(
                    "cannot copy {} into {} (disk full?)",
                    from.display(),
                    dst.display()
                )
            })?;
    }
    Ok(())
}

/// Files that travel with a model besides config and weights: tokenizer and processor files,
/// chat template, generation settings, licence. Every `*.py` (the remote code `auto_map` names,
/// and the modules it imports) and `*.tiktoken` travels too ([`is_side_file`]).
pub const SIDE_FILES: &[&str] = &[
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "preprocessor_config.json",
    "processor_config.json",
    "LICENSE",
    "LICENSE.txt",
    "LICENSE.md",
    "NOTICE",
];

/// Whether a file of a model folder (or hub repo, top level) travels into every output.
pub fn is_side_file(name: &str) -> bool {
    !name.contains('/')
        && (SIDE_FILES.contains(&name) || name.ends_with(".py") || name.ends_with(".tiktoken"))
}

/// The side files present in `dir`, in name order.
pub fn side_files(dir: &Path) -> Result<Vec<String>> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .with_context(|| format!("cannot list {}", dir.display()))?
        .filter_map(|e| e.ok())
        .filter(|e| e.path().is_file())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| is_side_file(n))
        .collect();
    names.sort();
    Ok(names)
}
