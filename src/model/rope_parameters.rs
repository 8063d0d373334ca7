//! transformers 5 writes a config's RoPE settings as one `rope_parameters` object
//! (`{"rope_type": "default", "rope_theta": 100000.0}`, with a scaling's own keys beside them)
//! instead of the top-level `rope_theta` and `rope_scaling`; GPTQModel 7.6 and AutoRound save
//! configs that way. Both spellings mean the same model (docs/llama.md, Configs).

use anyhow::{bail, Result};
use serde_json::Value;

/// Rewrites `rope_parameters` into the top-level `rope_theta` and `rope_scaling` the parsers
/// read. A key given both ways must agree: a config whose two spellings disagree is refused,
/// naming both, rather than read one way here and the other way by an engine.
pub fn lift(config: &mut Value) -> Result<()> {
    let Some(params) = config
        .get("rope_parameters")
        .filter(|p| !p.is_null())
        .cloned()
    else {
        return Ok(());
    };
    let Some(p) = params.as_object() else {
        bail!("rope_parameters must be an object; got {params}");
    };
    if let Some(theta) = p.get("rope_theta") {
        match config.get("rope_theta") {
            Some(top) if !top.is_null() && top.as_f64() != theta.as_f64() => bail!(
                "rope_theta {top} and rope_parameters.rope_theta {theta} disagree: fix one of them"
            ),
            _ => config["rope_theta"] = theta.clone(),
        }
    }
    let mut scaling = p.clone();
    scaling.remove("rope_theta");
    let kind = scaling.get("rope_type").and_then(Value::as_str);
    if matches!(kind, None | Some("default")) {
        return Ok(());
    }
    match config.get("rope_scaling") {
        Some(top) if !top.is_null() && top != &Value::Object(scaling.clone()) => {
            bail!("rope_scaling {top} and rope_parameters {params} disagree: fix one of them")
        }
        _ => config["rope_scaling"] = Value::Object(scaling),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::lift;
    use serde_json::json;

    #[test]
    fn rope_parameters_become_the_top_level_keys() {
        let mut c = json!({"rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}});
        lift(&mut c).unwrap();
        assert_eq!(c["rope_theta"], 100000.0);
        assert!(c.get("rope_scaling").is_none());
        let l3 = json!({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0});
        let mut c = json!({ "rope_parameters": l3 });
        lift(&mut c).unwrap();
        assert_eq!(c["rope_theta"], 500000.0);
        assert_eq!(
            c["rope_scaling"],
            json!({"rope_type": "llama3", "factor": 8.0})
        );
        // Both spellings, agreeing: accepted; an old config without rope_parameters: unchanged.
        let mut c = json!({"rope_theta": 1e4, "rope_parameters": {"rope_theta": 1e4}});
        lift(&mut c).unwrap();
        let mut c = json!({"rope_theta": 1e4, "rope_scaling": null});
        let before = c.clone();
        lift(&mut c).unwrap();
        assert_eq!(c, before);
    }

    #[test]
    fn disagreeing_spellings_are_refused_naming_both() {
        let mut c = json!({"rope_theta": 1e4, "rope_parameters": {"rope_theta": 1e5}});
        let e = lift(&mut c).unwrap_err().to_string();
        assert!(
            e.contains("rope_parameters.rope_theta") && e.contains("disagree"),
            "{e}"
        );
        let mut c = json!({"rope_scaling": {"rope_type": "linear", "factor": 2.0},
            "rope_parameters": {"rope_type": "linear", "factor": 4.0}});
        let e = lift(&mut c).unwrap_err().to_string();
        assert!(e.contains("rope_scaling") && e.contains("disagree"), "{e}");
        let mut c = json!({"rope_parameters": [1]});
        assert!(lift(&mut c).is_err());
    }
}
