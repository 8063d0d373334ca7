//! Where a model comes from: a local folder, or a Hugging Face hub repo id resolved through the
//! standard cache (`HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`),
//! honouring `HF_HUB_OFFLINE=1` and a token from `HF_TOKEN` or the token file. Only the files a
//! model needs are fetched: config, the safetensors index and the shards it names, and the side
//! files every output carries ([`is_side_file`]: tokenizer and processor files, generation
//! config, licence, and the remote code that `auto_map` names).

pub mod remote_code;

use crate::checkpoint::files::{is_side_file, SIDE_FILES};
use anyhow::{anyhow, bail, Context, Result};
use hf_hub::{Cache, Repo, RepoType};
use std::path::{Path, PathBuf};

/// A resolved model: a folder holding config.json and the safetensors files.
#[derive(Debug, Clone)]
pub struct ModelSource {
    pub dir: PathBuf,
    /// `org/name@revision` for hub models, the folder otherwise (for reports).
    pub description: String,
}

pub fn is_offline() -> bool {
    std::env::var("HF_HUB_OFFLINE")
        .map(|v| {
            matches!(
                v.trim().to_ascii_lowercase().as_str(),
                "1" | "true" | "yes" | "on"
            )
        })
        .unwrap_or(false)
}

fn hf_home() -> PathBuf {
    if let Ok(h) = std::env::var("HF_HOME") {
        return PathBuf::from(h);
    }
    let base = std::env::var("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            PathBuf::from(std::env::var("HOME").unwrap_or_else(|_| ".".into())).join(".cache")
        });
    base.join("huggingface")
}

/// The hub cache folder, as huggingface_hub resolves it.
pub fn hub_cache_dir() -> PathBuf {
    match std::env::var("HF_HUB_CACHE") {
        Ok(p) => PathBuf::from(p),
        Err(_) => hf_home().join("hub"),
    }
}

/// A token from `HF_TOKEN` (or the older `HUGGING_FACE_HUB_TOKEN`), else the token file
/// (`HF_TOKEN_PATH`, else `$HF_HOME/token`).
pub fn token() -> Option<String> {
    for var in ["HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"] {
        if let Ok(t) = std::env::var(var) {
            if !t.trim().is_empty() {
                return Some(t.trim().to_string());
            }
        }
    }
    let path = std::env::var("HF_TOKEN_PATH")
        .map(PathBuf::from)
        .unwrap_or_else(|_| hf_home().join("token"));
    std::fs::read_to_string(path)
        .ok()
        .map(|t| t.trim().to_string())
        .filter(|t| !t.is_empty())
}

fn looks_like_repo_id(s: &str) -> bool {
    let parts: Vec<&str> = s.split('/').collect();
    parts.len() == 2
        && parts.iter().all(|p| {
            !p.is_empty()
                && !p.starts_with('.')
                && p.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        })
}

/// `--model` and `--revision`, as every command that reads a 16-bit model takes them.
#[derive(clap::Args, Clone, Debug)]
pub struct ModelArgs {
    /// Model folder or hub repo id (org/name).
    #[arg(long)]
    pub model: String,
    /// Hub revision (branch, tag or commit) when --model is a repo id.
    #[arg(long)]
    pub revision: Option<String>,
}

impl ModelArgs {
    /// Resolves the model ([`resolve`]).
    pub fn resolve(&self) -> Result<ModelSource> {
        resolve(&self.model, self.revision.as_deref())
    }

    /// Where the model's files are before it is resolved (what an output is checked against
    /// before anything is downloaded): its folder in the hub cache for a repo id, else the path
    /// as given.
    pub fn local_path(&self) -> PathBuf {
        cache_repo_dir(&self.model).unwrap_or_else(|| PathBuf::from(&self.model))
    }
}

/// The cache folder (`models--org--name`) that a hub `--model` resolves into, whether or not
/// it exists yet; `None` when `spec` is a local path.
pub fn cache_repo_dir(spec: &str) -> Option<PathBuf> {
    (!Path::new(spec).exists() && looks_like_repo_id(spec))
        .then(|| hub_cache_dir().join(format!("models--{}", spec.replace('/', "--"))))
}

/// Resolves `--model`: an existing folder, else a hub repo id.
pub fn resolve(spec: &str, revision: Option<&str>) -> Result<ModelSource> {
    let path = Path::new(spec);
    if path.is_dir() {
        if revision.is_some() {
            bail!("--revision applies to hub repo ids, but --model {spec} is a local folder");
        }
        if !path.join("config.json").is_file() {
            bail!("{} has no config.json: not a model folder", path.display());
        }
        return Ok(ModelSource {
            dir: path.to_path_buf(),
            description: path.display().to_string(),
        });
    }
    if path.exists() {
        bail!(
            "--model {spec} is a file: pass the folder that holds config.json and the safetensors"
        );
    }
    if !looks_like_repo_id(spec) {
        bail!("--model {spec}: no such folder, and not a hub repo id of the form org/name");
    }
    let rev = revision.unwrap_or("main");
    check_revision(rev)?;
    let dir = if is_offline() {
        resolve_offline(spec, rev)?
    } else {
        resolve_online(spec, rev)?
    };
    Ok(ModelSource {
        dir,
        description: format!("{spec}@{rev}"),
    })
}

/// The snapshot folder for `repo@rev` in the cache: `refs/<rev>` names the commit, or `rev`
/// is itself a commit hash.
fn snapshot_dir(cache: &Path, repo: &str, rev: &str) -> Result<Option<PathBuf>> {
    let root = cache.join(format!("models--{}", repo.replace('/', "--")));
    let commit = match std::fs::read_to_string(root.join("refs").join(rev)) {
        Ok(s) => {
            let c = s.trim().to_string();
            if !is_commit_hash(&c) {
                bail!(
                    "{} names {c:?}, which is not a commit hash: the cache is damaged; delete that \
                     file and fetch {repo}@{rev} again without HF_HUB_OFFLINE",
                    root.join("refs").join(rev).display()
                );
            }
            c
        }
        Err(_) => rev.to_string(),
    };
    let dir = root.join("snapshots").join(commit);
    Ok(dir.is_dir().then_some(dir))
}

fn is_commit_hash(s: &str) -> bool {
    s.len() == 40 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// A revision is a branch, tag or commit name (`main`, `v1.0`, `refs/pr/4`, a hash): it becomes
/// a path inside the cache, so `..`, `.`, empty or absolute segments and backslashes are refused.
pub fn check_revision(rev: &str) -> Result<()> {
    let bad = rev.is_empty()
        || rev.starts_with('/')
        || rev.contains('\\')
        || rev.contains('\0')
        || rev
            .split('/')
            .any(|seg| seg.is_empty() || seg == "." || seg == "..");
    if bad {
        bail!(
            "--revision {rev:?} is not a branch, tag or commit name (no empty, `.` or `..` path \
             segments, no leading `/`): pass e.g. main, v1.0, refs/pr/4 or a commit hash"
        );
    }
    Ok(())
}

fn weight_files(dir: &Path) -> Result<Vec<String>> {
    let index = dir.join(crate::checkpoint::reader::INDEX_FILE);
    if index.is_file() {
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&index)?)
            .with_context(|| format!("{} is not valid JSON", index.display()))?;
        let map = v["weight_map"]
            .as_object()
            .ok_or_else(|| anyhow!("{} has no weight_map", index.display()))?;
        let mut files: Vec<String> = map
            .values()
            .filter_map(|f| f.as_str().map(str::to_string))
            .collect();
        files.sort();
        files.dedup();
        Ok(files)
    } else {
        Ok(vec![crate::checkpoint::reader::SINGLE_FILE.to_string()])
    }
}

fn resolve_offline(repo: &str, rev: &str) -> Result<PathBuf> {
    let cache = hub_cache_dir();
    let not_cached = || {
        anyhow!(
            "{repo}@{rev} is not in the Hugging Face cache at {} and HF_HUB_OFFLINE=1 forbids downloading: \
             run once without HF_HUB_OFFLINE, or pass a local folder to --model",
            cache.display()
        )
    };
    let dir = snapshot_dir(&cache, repo, rev)?.ok_or_else(not_cached)?;
    if !dir.join("config.json").is_file() {
        return Err(not_cached());
    }
    for f in weight_files(&dir)? {
        if !dir.join(&f).is_file() {
            bail!(
                "{repo}@{rev} is only partly in the cache at {}: {f} is missing and HF_HUB_OFFLINE=1 forbids downloading it",
                dir.display()
            );
        }
    }
    if let Some((f, why)) = remote_code::folder_remote_code(&dir).1.first() {
        bail!(
            "{repo}@{rev} is only partly in the cache at {}: {f} (needed by {why}) is missing and \
             HF_HUB_OFFLINE=1 forbids downloading it; run once without HF_HUB_OFFLINE",
            dir.display()
        );
    }
    Ok(dir)
}

fn resolve_online(repo: &str, rev: &str) -> Result<PathBuf> {
    let cache = hub_cache_dir();
    let api = hf_hub::api::sync::ApiBuilder::from_cache(Cache::new(cache.clone()))
        .with_token(token())
        .with_progress(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .build()
        .context("cannot set up the Hugging Face hub client")?;
    let api_repo = api.repo(Repo::with_revision(
        repo.to_string(),
        RepoType::Model,
        rev.to_string(),
    ));
    let config = api_repo.get("config.json").map_err(|e| {
        anyhow!("cannot fetch config.json of {repo}@{rev} from the hub ({e}); check the repo id, the revision, your token (HF_TOKEN) and the network, or set HF_HUB_OFFLINE=1 to use the cache")
    })?;
    let dir = config
        .parent()
        .expect("a cached file has a folder")
        .to_path_buf();
    match api_repo.info() {
        // The repo's file list: fetch every side file it has.
        Ok(info) => {
            let mut names: Vec<String> = info
                .siblings
                .into_iter()
                .map(|s| s.rfilename)
                .filter(|n| is_side_file(n))
                .collect();
            names.sort();
            for f in names {
                api_repo
                    .get(&f)
                    .map_err(|e| anyhow!("cannot fetch {f} of {repo}@{rev}: {e}"))?;
            }
        }
        // No listing (an endpoint without the API): try the known names; absent ones are 404s.
        Err(_) => {
            for f in SIDE_FILES {
                let _ = api_repo.get(f);
            }
        }
    }
    // The remote code auto_map names, and what it imports, whether or not the listing had it.
    let mut fetched: Vec<String> = vec![];
    loop {
        let (_, missing) = remote_code::folder_remote_code(&dir);
        let Some((f, why)) = missing.first() else {
            break;
        };
        if fetched.contains(f) {
            bail!(
                "{f} of {repo}@{rev} (needed by {why}) was fetched but is not in {}",
                dir.display()
            );
        }
        api_repo
            .get(f)
            .map_err(|e| anyhow!("cannot fetch {f} of {repo}@{rev}, which {why} needs: {e}"))?;
        fetched.push(f.clone());
    }
    let index = api_repo.get(crate::checkpoint::reader::INDEX_FILE).ok();
    if index.is_none() {
        api_repo
            .get(crate::checkpoint::reader::SINGLE_FILE)
            .map_err(|e| anyhow!("{repo}@{rev} has neither model.safetensors.index.json nor model.safetensors ({e})"))?;
    }
    for f in weight_files(&dir)? {
        api_repo
            .get(&f)
            .map_err(|e| anyhow!("cannot fetch {f} of {repo}@{rev}: {e}"))?;
    }
    Ok(dir)
}

/// Checks the SHA-256 of every shard (`sums`: file name → hash, computed once by the caller)
/// against what the files claim to be: in a hub cache a shard is a symlink to
/// `blobs/<sha256>` (large files are stored under their SHA-256), and one of our outputs lists
/// every hash in `manifest.json`. A truncated download or a corrupted blob is caught here,
/// before a single layer runs, with the fix.
pub fn verify_shards(dir: &Path, sums: &std::collections::BTreeMap<String, String>) -> Result<()> {
    let manifest: Option<serde_json::Value> = std::fs::read_to_string(dir.join("manifest.json"))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok());
    for (name, sha) in sums {
        let path = dir.join(name);
        if let Ok(target) = std::fs::read_link(&path) {
            let blob = target
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            let is_sha = blob.len() == 64 && blob.bytes().all(|b| b.is_ascii_hexdigit());
            if is_sha && !blob.eq_ignore_ascii_case(sha) {
                let blob_path = path.parent().unwrap_or(dir).join(&target);
                bail!(
                    "{} in the Hugging Face cache is corrupted or incomplete: its SHA-256 is {sha}, \
                     but the hub's is {blob} (the blob's name); delete {} and run again without \
                     HF_HUB_OFFLINE to download it again",
                    path.display(),
                    blob_path.display()
                );
            }
        }
        if let Some(want) = manifest
            .as_ref()
            .and_then(|m| m["files"][name.as_str()]["sha256"].as_str())
        {
            if want != sha {
                bail!(
                    "{} does not match its manifest.json (SHA-256 {sha}, expected {want}): the \
                     file was modified or damaged after it was written; re-create or re-download it",
                    path.display()
                );
            }
        }
    }
    Ok(())
}
