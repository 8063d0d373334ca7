//! The output folder: written to `<out>.partial` and renamed into place by
//! [`OutputDir::commit`] only when complete, with `manifest.json` written last; an old output is
//! replaced only with `--force` and only once the new one is in place.

use super::files::copy_files;
use super::guard;
use super::manifest::{write_manifest_with, HashedFile, MANIFEST_FILE};
use super::reader::INDEX_FILE;
use crate::interrupt::RESUMABLE_MARKER;
use anyhow::{bail, Context, Result};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// An output folder under construction: everything is written to `<out>.partial`, and only
/// [`OutputDir::commit`] moves it to `<out>`. Dropped without commit, the partial folder is
/// removed, so a failed run never leaves a half-written checkpoint behind.
///
/// Opening one checks the output against the command's inputs ([`guard::check_output`]) and
/// takes the advisory lock on `<out>.lock` for as long as it lives. An existing `<out>` is
/// replaced only with `force`, only when it is a model folder (or empty), and only once the new
/// output is complete: [`OutputDir::commit`] moves the old folder aside, renames the new one into
/// place and then deletes the old one.
pub struct OutputDir {
    pub out: PathBuf,
    pub partial: PathBuf,
    done: bool,
    keep_partial: bool,
    /// Files copied byte for byte from the source, listed in the manifest.
    copied: Vec<String>,
    /// Files written with their hashes (the shards), which the manifest does not re-read.
    hashed: BTreeMap<String, HashedFile>,
    _interrupt: crate::interrupt::Registration,
    _lock: guard::OutputLock,
}

/// Files whose presence marks a folder as a model folder that `--force` may replace.
const MODEL_FOLDER_MARKERS: &[&str] = &["config.json", MANIFEST_FILE, INDEX_FILE];

/// `<out>.replaced`: where [`OutputDir::commit`] parks the old output while the new one moves in.
fn replaced_path(out: &Path) -> PathBuf {
    let mut s = out.as_os_str().to_os_string();
    s.push(".replaced");
    PathBuf::from(s)
}

/// A commit stopped between its two renames leaves the old output in `<out>.replaced` and no
/// `<out>`: put the old output back, so it is never hidden from the user.
fn restore_interrupted_commit(out: &Path) -> Result<()> {
    let replaced = replaced_path(out);
    if out.symlink_metadata().is_err() && replaced.symlink_metadata().is_ok() {
        std::fs::rename(&replaced, out).with_context(|| {
            format!(
                "an earlier run stopped while replacing {}; cannot move {} back",
                out.display(),
                replaced.display()
            )
        })?;
        eprintln!(
            "note: an earlier run stopped while replacing {}; the previous output was put back",
            out.display()
        );
    }
    Ok(())
}

/// Refuses to replace `out` unless `force` is given and `out` is a folder that holds a model (or
/// nothing): `--force` on a folder of other files would delete them.
fn check_replaceable(out: &Path, force: bool) -> Result<()> {
    if out.symlink_metadata().is_err() {
        return Ok(());
    }
    if !force {
        bail!(
            "output {} already exists: pass --force to replace it, or choose another --out",
            out.display()
        );
    }
    if !out.is_dir() {
        bail!(
            "output {} exists and is not a folder: remove it yourself or choose another --out \
             (--force replaces model folders only)",
            out.display()
        );
    }
    let empty = std::fs::read_dir(out)
        .with_context(|| format!("cannot list {}", out.display()))?
        .next()
        .is_none();
    if !empty && !MODEL_FOLDER_MARKERS.iter().any(|m| out.join(m).is_file()) {
        bail!(
            "output {} exists and does not look like a model folder (no {}): --force replaces \
             model folders only, so nothing else is ever deleted; remove it yourself or choose \
             another --out",
            out.display(),
            MODEL_FOLDER_MARKERS.join(", ")
        );
    }
    Ok(())
}

impl OutputDir {
    /// Starts a new output at `out` (see the type's docs); `inputs` are every path the command
    /// reads, which the output may not alias.
    pub fn create(out: &Path, force: bool, inputs: &[guard::InputPath]) -> Result<Self> {
        let (partial, lock) = Self::claim(out, force, inputs)?;
        if partial.symlink_metadata().is_ok() {
            if partial.join(RESUMABLE_MARKER).is_file() && !force {
                bail!(
                    "{} holds the finished layers of an interrupted run: rerun the same command \
                     with --resume to continue it, or add --force to discard it and start over",
                    partial.display()
                );
            }
            remove_path(&partial)
                .with_context(|| format!("cannot remove stale {}", partial.display()))?;
        }
        std::fs::create_dir_all(&partial)
            .with_context(|| format!("cannot create {}", partial.display()))?;
        Ok(Self::held(out, partial, lock))
    }

    /// Reopens an existing partial folder (for `--resume`).
    pub fn reopen(out: &Path, force: bool, inputs: &[guard::InputPath]) -> Result<Self> {
        let (partial, lock) = Self::claim(out, force, inputs)?;
        if !partial.is_dir() {
            bail!("nothing to resume: {} does not exist", partial.display());
        }
        Ok(Self::held(out, partial, lock))
    }

    /// What `create` and `reopen` check first: `out` and its partial and replaced folders alias
    /// no input, the output lock is held, an interrupted commit is put back, and an existing
    /// `out` may be replaced. Returns the partial folder's path and the lock.
    fn claim(
        out: &Path,
        force: bool,
        inputs: &[guard::InputPath],
    ) -> Result<(PathBuf, guard::OutputLock)> {
        let partial = partial_path(out);
        guard::check_output("--out", out, &[partial.clone(), replaced_path(out)], inputs)?;
        let lock = guard::OutputLock::acquire("--out", out)?;
        restore_interrupted_commit(out)?;
        check_replaceable(out, force)?;
        Ok((partial, lock))
    }

    /// The output at `partial`, with the lock held and interrupts registered.
    fn held(out: &Path, partial: PathBuf, lock: guard::OutputLock) -> Self {
        Self {
            out: out.to_path_buf(),
            _interrupt: crate::interrupt::register(&partial, lock.path()),
            partial,
            done: false,
            keep_partial: false,
            copied: vec![],
            hashed: BTreeMap::new(),
            _lock: lock,
        }
    }

    pub fn path(&self) -> &Path {
        &self.partial
    }

    /// Copies side files from `src` byte for byte and records them for the manifest's
    /// `copied_from_source` list.
    pub fn copy_from_source(&mut self, src: &Path, names: &[String]) -> Result<()> {
        copy_files(src, &self.partial, names)?;
        for n in names {
            if !self.copied.contains(n) {
                self.copied.push(n.clone());
            }
        }
        self.copied.sort();
        Ok(())
    }

    /// Records files of the folder hashed while they were written (see
    /// [`write_sharded`](super::shards::write_sharded)): the manifest takes their hashes instead
    /// of reading them again.
    pub fn record_hashed(&mut self, files: &[HashedFile]) {
        for f in files {
            self.hashed.insert(f.name.clone(), f.clone());
        }
    }

    /// Keep `<out>.partial` when dropped without commit (a resumable run).
    pub fn keep_on_failure(&mut self, keep: bool) {
        self.keep_partial = keep;
    }

    /// Writes `manifest.json` and renames the partial folder into place. An old output is moved
    /// aside first and deleted only after the new one is in place; if the rename fails, the old
    /// output is put back.
    /// Subfolders (quantize's journal) are not part of the manifest, which lists files only.
    pub fn commit(mut self) -> Result<PathBuf> {
        write_manifest_with(&self.partial, &self.copied, &self.hashed)?;
        // Ctrl-C waits for the renames: the output is either the old one or the new one.
        let _renaming = crate::interrupt::critical();
        let replaced = replaced_path(&self.out);
        let had_old = self.out.symlink_metadata().is_ok();
        if had_old {
            if replaced.symlink_metadata().is_ok() {
                remove_path(&replaced)
                    .with_context(|| format!("cannot remove {}", replaced.display()))?;
            }
            crate::fault::point("before moving the old output aside");
            std::fs::rename(&self.out, &replaced).with_context(|| {
                format!(
                    "cannot move the old {} aside to {}",
                    self.out.display(),
                    replaced.display()
                )
            })?;
        }
        crate::fault::point("before renaming the new output into place");
        if let Err(e) = std::fs::rename(&self.partial, &self.out) {
            if had_old {
                let _ = std::fs::rename(&replaced, &self.out);
            }
            return Err(e).with_context(|| {
                format!(
                    "cannot rename {} to {}",
                    self.partial.display(),
                    self.out.display()
                )
            });
        }
        self.done = true;
        crate::fault::point("after renaming the new output into place");
        if had_old {
            remove_path(&replaced).with_context(|| {
                format!(
                    "the new {} is in place, but the old output could not be removed from {}",
                    self.out.display(),
                    replaced.display()
                )
            })?;
        }
        Ok(self.out.clone())
    }
}

/// Removes a folder tree, or a file or symlink (never following it).
fn remove_path(p: &Path) -> std::io::Result<()> {
    match p.symlink_metadata() {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(p),
        Ok(_) => std::fs::remove_file(p),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

impl Drop for OutputDir {
    fn drop(&mut self) {
        if !self.done && !self.keep_partial {
            let _ = std::fs::remove_dir_all(&self.partial);
        }
    }
}

pub fn partial_path(out: &Path) -> PathBuf {
    let mut s = out.as_os_str().to_os_string();
    s.push(".partial");
    PathBuf::from(s)
}

#[cfg(test)]
mod tests {
    use super::super::files::write_file;
    use super::super::manifest::verify_manifest;
    use super::*;

    #[test]
    fn output_dir_is_atomic_and_refuses_existing() {
        let root = tempfile::tempdir().unwrap();
        let out = root.path().join("q");
        {
            let od = OutputDir::create(&out, false, &[]).unwrap();
            write_file(&od.path().join("x.txt"), b"x").unwrap();
            // dropped without commit
        }
        assert!(!out.exists() && !partial_path(&out).exists());
        let od = OutputDir::create(&out, false, &[]).unwrap();
        write_file(&od.path().join("x.txt"), b"x").unwrap();
        od.commit().unwrap();
        assert!(out.join(MANIFEST_FILE).is_file());
        assert!(verify_manifest(&out).unwrap().is_empty());
        let err = OutputDir::create(&out, false, &[])
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("--force"), "{err}");
        std::fs::write(out.join("x.txt"), b"y").unwrap();
        let problems = verify_manifest(&out).unwrap();
        assert!(problems[0].starts_with("x.txt"), "{problems:?}");
    }
}
