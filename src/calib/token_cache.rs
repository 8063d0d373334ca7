//! Tokenized text kept between runs, when `SOAR_GPTQ_TOKEN_CACHE` names a folder
//! (docs/calibration.md, Token cache). Tokenizing the 2.3 MB default calibration text is most of a
//! small model's quantize on the CPU; the test suite runs hundreds of them with the same
//! tokenizer, and sets the variable. Off by default: a run reads and writes nothing else.
//!
//! An entry is keyed by the SHA-256 of the tokenizer (its JSON), the text and this format's
//! version; it holds the ids as little-endian u32 and the SHA-256 of those bytes. An entry that
//! does not check out is ignored and replaced, so the cache can only save time, never change ids.

use anyhow::{anyhow, Result};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

/// The variable naming the cache folder.
pub const ENV: &str = "SOAR_GPTQ_TOKEN_CACHE";

/// Bumped whenever the tokenization the ids depend on changes: the `tokenizers` crate's major
/// version or how the text is encoded.
const FORMAT: &str = "soar-gptq token cache 1, tokenizers 0.23, encode without special tokens";

/// The ids of `text` under `tokenizer` (no special tokens): from the cache folder when
/// `SOAR_GPTQ_TOKEN_CACHE` is set and holds them, else tokenized, and stored there when set.
pub fn encode(tokenizer: &tokenizers::Tokenizer, text: &str) -> Result<Vec<u32>> {
    let dir = std::env::var_os(ENV).filter(|d| !d.is_empty());
    encode_in(dir.as_deref().map(Path::new), tokenizer, text)
}

/// [`encode`] with the cache folder given (`None`: no cache).
fn encode_in(
    dir: Option<&Path>,
    tokenizer: &tokenizers::Tokenizer,
    text: &str,
) -> Result<Vec<u32>> {
    let tokenize = || -> Result<Vec<u32>> {
        Ok(tokenizer
            .encode(text, false)
            .map_err(|e| anyhow!("{e}"))?
            .get_ids()
            .to_vec())
    };
    let Some(dir) = dir else {
        return tokenize();
    };
    let path = entry_path(dir, tokenizer, text)?;
    if let Some(ids) = read_entry(&path) {
        return Ok(ids);
    }
    let ids = tokenize()?;
    // A cache that cannot be written only costs the next run the tokenization again.
    let _ = write_entry(&path, &ids);
    Ok(ids)
}

fn entry_path(dir: &Path, tokenizer: &tokenizers::Tokenizer, text: &str) -> Result<PathBuf> {
    let json = tokenizer
        .to_string(false)
        .map_err(|e| anyhow!("serializing the tokenizer for the token cache: {e}"))?;
    let mut h = Sha256::new();
    for part in [FORMAT.as_bytes(), json.as_bytes(), text.as_bytes()] {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part);
    }
    let key = crate::checkpoint::manifest::hex(&h.finalize());
    Ok(dir.join(format!("{key}.ids")))
}

/// The ids an entry holds, or `None` when it is missing or does not check out.
fn read_entry(path: &Path) -> Option<Vec<u32>> {
    let bytes = std::fs::read(path).ok()?;
    let (ids, sum) = bytes.split_at_checked(bytes.len().checked_sub(32)?)?;
    if ids.len() % 4 != 0 || Sha256::digest(ids).as_slice() != sum {
        return None;
    }
    Some(
        ids.chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
    )
}

/// Writes an entry beside its final name and renames it into place, so a reader sees a whole
/// entry or none.
fn write_entry(path: &Path, ids: &[u32]) -> Result<()> {
    let dir = path.parent().expect("entries live in the cache folder");
    std::fs::create_dir_all(dir)?;
    let mut bytes: Vec<u8> = ids.iter().flat_map(|i| i.to_le_bytes()).collect();
    let sum = Sha256::digest(&bytes);
    bytes.extend_from_slice(&sum);
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, &bytes)?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokenizer() -> tokenizers::Tokenizer {
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/tiny-sala/tokenizer.json");
        tokenizers::Tokenizer::from_file(&p).unwrap()
    }

    #[test]
    fn entries_round_trip_and_damaged_ones_are_ignored() {
        let tmp = tempfile::tempdir().unwrap();
        let tok = tokenizer();
        let text = "Four score and seven years ago our fathers brought forth";
        let want = tok.encode(text, false).unwrap().get_ids().to_vec();
        let path = entry_path(tmp.path(), &tok, text).unwrap();
        assert!(read_entry(&path).is_none());
        write_entry(&path, &want).unwrap();
        assert_eq!(read_entry(&path).unwrap(), want);
        // Another text or another tokenizer is another entry.
        assert_ne!(path, entry_path(tmp.path(), &tok, "Four score").unwrap());
        let mut other = tok.clone();
        other
            .add_special_tokens([tokenizers::AddedToken::from("<x>", true)])
            .unwrap();
        assert_ne!(path, entry_path(tmp.path(), &other, text).unwrap());
        // A flipped bit, a truncated file and a stray byte are misses, not wrong ids.
        let good = std::fs::read(&path).unwrap();
        let mut flipped = good.clone();
        flipped[0] ^= 1;
        for bad in [
            flipped,
            good[..good.len() - 1].to_vec(),
            [&good[..], &[0]].concat(),
        ] {
            std::fs::write(&path, bad).unwrap();
            assert!(read_entry(&path).is_none());
        }
        assert!(read_entry(&tmp.path().join("missing.ids")).is_none());
    }

    #[test]
    fn encode_stores_on_a_miss_and_reads_on_a_hit() {
        let tmp = tempfile::tempdir().unwrap();
        let tok = tokenizer();
        let text = "We the People of the United States";
        let want = tok.encode(text, false).unwrap().get_ids().to_vec();
        assert_eq!(encode_in(None, &tok, text).unwrap(), want);
        // A miss tokenizes and stores the entry (the damaged one above is replaced too).
        let path = entry_path(tmp.path(), &tok, text).unwrap();
        std::fs::write(&path, b"damaged").unwrap();
        assert_eq!(encode_in(Some(tmp.path()), &tok, text).unwrap(), want);
        assert_eq!(read_entry(&path).unwrap(), want);
        // A hit returns what the entry holds: the tokenizer is not run again.
        write_entry(&path, &[7, 8, 9]).unwrap();
        assert_eq!(encode_in(Some(tmp.path()), &tok, text).unwrap(), [7, 8, 9]);
        // No stray temporary files.
        assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 1);
    }
}
