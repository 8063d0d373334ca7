//! Remote code: the Python files a model folder's `auto_map` entries name (in `config.json`
//! and `tokenizer_config.json`), found as transformers finds them. An entry `module.Class`
//! resolves to `module.py` beside config.json, whose relative imports (`from .x import ...`,
//! found by pattern over the whole text) are needed too; `repo--module.Class` names code in
//! another hub repo. Tokenizer entries may be `[slow, fast]` lists with nulls.

use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// One `auto_map` reference: the class key (`AutoConfig`, `AutoTokenizer`...), the reference as
/// written, and the module file it resolves to (`None` for code in another repo).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct AutoMapRef {
    /// `config.json` or `tokenizer_config.json`.
    pub file: String,
    pub class_key: String,
    pub reference: String,
    pub module_file: Option<String>,
}

/// Every `auto_map` reference of a config object (`auto_map` values may be strings or, for
/// tokenizers, `[slow, fast]` lists with nulls).
pub fn auto_map_refs(file: &str, config: &Value) -> Vec<AutoMapRef> {
    let Some(map) = config.get("auto_map").and_then(Value::as_object) else {
        return vec![];
    };
    let mut out = vec![];
    for (key, v) in map {
        let refs: Vec<&str> = match v {
            Value::String(s) => vec![s.as_str()],
            Value::Array(a) => a.iter().filter_map(Value::as_str).collect(),
            _ => vec![],
        };
        for r in refs {
            let local = !r.contains("--");
            let module_file = local
                .then(|| r.split_once('.').map(|(m, _)| format!("{m}.py")))
                .flatten();
            out.push(AutoMapRef {
                file: file.to_string(),
                class_key: key.clone(),
                reference: r.to_string(),
                module_file,
            });
        }
    }
    out
}

/// Module names of a Python file's relative imports (`from .x import y`, `import .x`), found
/// the way transformers finds them: by pattern over the whole text, indented lines included.
pub fn relative_imports(source: &str) -> Vec<String> {
    let mut out = BTreeSet::new();
    for line in source.lines() {
        let t = line.trim_start();
        let rest = if let Some(r) = t.strip_prefix("from .") {
            r
        } else if let Some(r) = t.strip_prefix("import .") {
            r
        } else {
            continue;
        };
        let name: String = rest
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if !name.is_empty() {
            out.insert(name);
        }
    }
    out.into_iter().collect()
}

/// The local Python files a set of `auto_map` references needs: each module file and,
/// recursively, the files its relative imports name. Returns (needed files in order, the file
/// that first needed each, missing ones).
pub fn remote_code_closure(
    refs: &[AutoMapRef],
    files: &BTreeSet<String>,
    texts: &BTreeMap<String, String>,
) -> (Vec<String>, Vec<(String, String)>) {
    let mut needed: Vec<String> = vec![];
    let mut missing: Vec<(String, String)> = vec![];
    let mut queue: Vec<(String, String)> = refs
        .iter()
        .filter_map(|r| {
            r.module_file
                .clone()
                .map(|f| (f, format!("{} auto_map.{}", r.file, r.class_key)))
        })
        .collect();
    while let Some((f, why)) = queue.pop() {
        if needed.contains(&f) || missing.iter().any(|(m, _)| m == &f) {
            continue;
        }
        if !files.contains(&f) {
            missing.push((f, why));
            continue;
        }
        if let Some(text) = texts.get(&f) {
            for m in relative_imports(text) {
                queue.push((format!("{m}.py"), format!("a relative import in {f}")));
            }
        }
        needed.push(f);
    }
    needed.sort();
    missing.sort();
    (needed, missing)
}

/// The remote-code files a model folder needs and the ones it lacks (with what needs them).
pub fn folder_remote_code(dir: &Path) -> (Vec<String>, Vec<(String, String)>) {
    let read = |name: &str| -> Option<Value> {
        serde_json::from_str(&std::fs::read_to_string(dir.join(name)).ok()?).ok()
    };
    let mut refs = vec![];
    if let Some(c) = read("config.json") {
        refs.extend(auto_map_refs("config.json", &c));
    }
    if let Some(t) = read("tokenizer_config.json") {
        refs.extend(auto_map_refs("tokenizer_config.json", &t));
    }
    let files: BTreeSet<String> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter(|e| e.path().is_file())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    let texts: BTreeMap<String, String> = files
        .iter()
        .filter(|f| f.ends_with(".py"))
        .filter_map(|f| {
            let b = std::fs::read(dir.join(f)).ok()?;
            Some((f.clone(), String::from_utf8_lossy(&b).into_owned()))
        })
        .collect();
    remote_code_closure(&refs, &files, &texts)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn auto_map_references_resolve_to_module_files() {
        let cfg = json!({"auto_map": {
            "AutoConfig": "configuration_minicpm_sala.MiniCPMSALAConfig",
            "AutoModel": "other/repo--modeling_x.Model",
            "AutoTokenizer": ["tokenization_x.Slow", null]
        }});
        let refs = auto_map_refs("config.json", &cfg);
        let files: Vec<Option<&str>> = refs.iter().map(|r| r.module_file.as_deref()).collect();
        assert_eq!(
            files,
            vec![
                Some("configuration_minicpm_sala.py"),
                None,
                Some("tokenization_x.py")
            ]
        );
    }

    #[test]
    fn relative_imports_are_followed_and_missing_files_named() {
        let text = "import torch\nfrom .configuration_minicpm_sala import MiniCPMSALAConfig\n\
                    try:\n    from .helpers import x\nexcept ImportError:\n    pass\nfrom . import y\n";
        assert_eq!(
            relative_imports(text),
            vec!["configuration_minicpm_sala", "helpers"]
        );
        let refs = auto_map_refs(
            "config.json",
            &json!({"auto_map": {"AutoModelForCausalLM": "modeling_minicpm_sala.M"}}),
        );
        let files: BTreeSet<String> = ["modeling_minicpm_sala.py", "configuration_minicpm_sala.py"]
            .map(String::from)
            .into();
        let texts = BTreeMap::from([("modeling_minicpm_sala.py".to_string(), text.to_string())]);
        let (needed, missing) = remote_code_closure(&refs, &files, &texts);
        assert_eq!(
            needed,
            vec!["configuration_minicpm_sala.py", "modeling_minicpm_sala.py"]
        );
        assert_eq!(missing.len(), 1);
        assert_eq!(missing[0].0, "helpers.py");
        assert!(missing[0].1.contains("modeling_minicpm_sala.py"));
    }
}
