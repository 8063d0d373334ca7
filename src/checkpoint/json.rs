//! A check JSON parsers skip: a key given twice in one object. serde_json keeps the last one
//! silently, so a config.json or safetensors header with `"bits": 4, ..., "bits": 8` would be
//! read as whatever the later key says, while another reader may take the first.

use serde::de::{DeserializeSeed, Deserializer, Error, MapAccess, SeqAccess, Visitor};
use std::collections::HashSet;
use std::fmt;

const MARK: &str = "duplicate key ";

struct Walk {
    path: String,
}

impl Walk {
    fn child(&self, key: &str) -> Walk {
        Walk {
            path: if self.path.is_empty() {
                key.to_string()
            } else {
                format!("{}.{key}", self.path)
            },
        }
    }
}

impl<'de> DeserializeSeed<'de> for Walk {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Walk {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }
    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }
    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }
    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let mut i = 0usize;
        while seq
            .next_element_seed(Walk {
                path: format!("{}[{i}]", self.path),
            })?
            .is_some()
        {
            i += 1;
        }
        Ok(())
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let mut seen = HashSet::new();
        while let Some(k) = map.next_key::<String>()? {
            let child = self.child(&k);
            if !seen.insert(k) {
                return Err(A::Error::custom(format!("{MARK}{}", child.path)));
            }
            map.next_value_seed(child)?;
        }
        Ok(())
    }
}

/// The dotted path of the first key that appears twice in one object of `text`
/// (`quantization_config.bits`); `None` when there is none or the text is not JSON (the caller's
/// parse reports that).
pub fn duplicate_key(text: &[u8]) -> Option<String> {
    let mut de = serde_json::Deserializer::from_slice(text);
    match (Walk {
        path: String::new(),
    })
    .deserialize(&mut de)
    {
        Err(e) => {
            let msg = e.to_string();
            msg.strip_prefix(MARK)
                .map(|rest| rest.split(" at line ").next().unwrap_or(rest).to_string())
        }
        Ok(()) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn duplicate_keys_are_found_at_any_depth() {
        assert_eq!(duplicate_key(br#"{"a": 1, "b": 2}"#), None);
        assert_eq!(duplicate_key(br#"{"a": 1, "a": 2}"#).as_deref(), Some("a"));
        assert_eq!(
            duplicate_key(br#"{"q": {"bits": 4, "x": [{"k": 1, "k": 2}]}}"#).as_deref(),
            Some("q.x[0].k")
        );
        assert_eq!(
            duplicate_key(br#"{"q": {"bits": 4, "bits": 8}}"#).as_deref(),
            Some("q.bits")
        );
        // The same key in sibling objects is fine; invalid JSON is left to the parser.
        assert_eq!(duplicate_key(br#"[{"a": 1}, {"a": 2}]"#), None);
        assert_eq!(duplicate_key(b"{oops"), None);
    }
}
