//! A Hugging Face `tokenizer.json` rebuilt from the tokenizer a GGUF file carries in its
//! metadata (`tokenizer.ggml.*`): the vocabulary, the BPE merges, the token types (control and
//! user-defined tokens become added tokens), and the pre-tokenizer that `tokenizer.ggml.pre`
//! names. Only GPT-2 style byte-level BPE (`tokenizer.ggml.model = "gpt2"`) is rebuilt.

use anyhow::{bail, Context, Result};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::processors::PostProcessorWrapper;
use tokenizers::{AddedToken, Tokenizer};

/// GGUF token types (llama.cpp `llama_token_type`).
pub const TOKEN_NORMAL: i32 = 1;
pub const TOKEN_UNKNOWN: i32 = 2;
pub const TOKEN_CONTROL: i32 = 3;
pub const TOKEN_USER_DEFINED: i32 = 4;
pub const TOKEN_UNUSED: i32 = 5;
pub const TOKEN_BYTE: i32 = 6;

/// The tokenizer metadata of a GGUF file.
#[derive(Debug, Clone, Default)]
pub struct GgufVocab {
    /// `tokenizer.ggml.model`.
    pub model: String,
    /// `tokenizer.ggml.pre` (absent in older files: the GPT-2 pre-tokenizer).
    pub pre: Option<String>,
    pub tokens: Vec<String>,
    /// One per token; all normal when the file has no `tokenizer.ggml.token_type`.
    pub types: Vec<i32>,
    /// `"left right"` pairs, highest priority first.
    pub merges: Vec<String>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub unk: Option<u32>,
    pub pad: Option<u32>,
    pub add_bos: bool,
    pub add_eos: bool,
    pub chat_template: Option<String>,
}

/// `tokenizer.ggml.pre` values that mean GPT-2's byte-level regex alone.
const PRE_GPT2: &[&str] = &["default", "gpt2", "gpt-2"];
/// Values whose pre-tokenizer first splits every digit on its own, then applies GPT-2's regex
/// (llama.cpp groups them; SmolLM2 is "smollm").
const PRE_DIGITS_GPT2: &[&str] = &["smollm", "starcoder", "refact", "codeshell"];

impl GgufVocab {
    /// The token with id `id`, for messages and tokenizer_config.json.
    pub fn token(&self, id: Option<u32>) -> Option<&str> {
        id.and_then(|i| self.tokens.get(i as usize))
            .map(String::as_str)
    }

    /// Tokens that become added tokens: (id, content, special).
    pub fn added(&self) -> Vec<(u32, &str, bool)> {
        self.types
            .iter()
            .enumerate()
            .filter(|(_, &t)| t == TOKEN_CONTROL || t == TOKEN_USER_DEFINED)
            .map(|(i, &t)| (i as u32, self.tokens[i].as_str(), t == TOKEN_CONTROL))
            .collect()
    }

    pub fn build(&self) -> Result<Tokenizer> {
        if self.model != "gpt2" {
            bail!(
                "tokenizer.ggml.model is {:?}: import-gguf rebuilds GPT-2 style byte-level BPE tokenizers (\"gpt2\") only",
                self.model
            );
        }
        if self.types.len() != self.tokens.len() {
            bail!(
                "tokenizer.ggml.token_type has {} entries for {} tokens",
                self.types.len(),
                self.tokens.len()
            );
        }
        let pre_tokenizer = self.pre_tokenizer()?;
        let mut tok = Tokenizer::new(self.bpe()?);
        tok.with_pre_tokenizer(Some(pre_tokenizer));
        tok.with_decoder(Some(ByteLevelDecoder::default()));
        tok.with_post_processor(Some(self.post_processor()?));
        let (special, normal): (Vec<_>, Vec<_>) = self.added().into_iter().partition(|a| a.2);
        let added = |v: Vec<(u32, &str, bool)>, s: bool| -> Vec<AddedToken> {
            v.into_iter()
                .map(|(_, c, _)| AddedToken::from(c.to_string(), s).normalized(false))
                .collect()
        };
        tok.add_special_tokens(added(special, true))
            .map_err(|e| anyhow::anyhow!("cannot add the control tokens: {e}"))?;
        tok.add_tokens(added(normal, false))
            .map_err(|e| anyhow::anyhow!("cannot add the user-defined tokens: {e}"))?;
        Ok(tok)
    }

    /// The pre-tokenizer `tokenizer.ggml.pre` names: GPT-2's byte-level regex, optionally after
    /// splitting single digits.
    fn pre_tokenizer(&self) -> Result<PreTokenizerWrapper> {
        let pre = self.pre.as_deref().unwrap_or("default");
        let byte_level = ByteLevel::new(false, true, true);
        Ok(if PRE_GPT2.contains(&pre) {
            byte_level.into()
        } else if PRE_DIGITS_GPT2.contains(&pre) {
            Sequence::new(vec![Digits::new(true).into(), byte_level.into()]).into()
        } else {
            bail!(
                "tokenizer.ggml.pre is {pre:?}: import-gguf knows the pre-tokenizers {} (GPT-2 byte-level regex) and {} (single digits, then the GPT-2 regex)",
                PRE_GPT2.join(", "),
                PRE_DIGITS_GPT2.join(", ")
            );
        })
    }

    /// The BPE model of the tokens and merges; refused when a token is given twice or a merge
    /// names a token the vocabulary lacks.
    fn bpe(&self) -> Result<BPE> {
        let mut vocab = Vocab::default();
        for (i, t) in self.tokens.iter().enumerate() {
            if let Some(prev) = vocab.insert(t.clone(), i as u32) {
                bail!("tokenizer.ggml.tokens holds {t:?} twice (ids {prev} and {i})");
            }
        }
        let mut merges = Vec::with_capacity(self.merges.len());
        for (i, m) in self.merges.iter().enumerate() {
            let (a, b) = m.split_once(' ').with_context(|| {
                format!(
                    "tokenizer.ggml.merges[{i}] is {m:?}: expected two tokens separated by a space"
                )
            })?;
            for part in [a, b, &format!("{a}{b}")] {
                if !vocab.contains_key(part) {
                    bail!("tokenizer.ggml.merges[{i}] ({m:?}) needs {part:?}, which is not in the vocabulary");
                }
            }
            merges.push((a.to_string(), b.to_string()));
        }
        BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(|e| anyhow::anyhow!("cannot build the BPE model: {e}"))
    }

    /// The post-processor: a template adding the BOS and EOS tokens the metadata asks for, or
    /// the byte-level one when it asks for neither.
    fn post_processor(&self) -> Result<PostProcessorWrapper> {
        if !(self.add_bos || self.add_eos) {
            return Ok(ByteLevel::new(false, true, true).into());
        }
        let mut single = vec![];
        let mut specials = vec![];
        for (on, id, what) in [
            (self.add_bos, self.bos, "bos"),
            (self.add_eos, self.eos, "eos"),
        ] {
            if !on {
                continue;
            }
            let t = self.token(id).with_context(|| {
                format!("tokenizer.ggml.add_{what}_token is true but tokenizer.ggml.{what}_token_id is missing or out of range")
            })?;
            specials.push((t.to_string(), id.unwrap()));
            single.push(t.to_string());
        }
        let (bos, eos) = (
            self.add_bos.then(|| single[0].clone()),
            self.add_eos.then(|| single.last().unwrap().clone()),
        );
        let seq = |x: &str| {
            [bos.clone(), Some(x.to_string()), eos.clone()]
                .into_iter()
                .flatten()
                .collect::<Vec<_>>()
                .join(" ")
        };
        Ok(TemplateProcessing::builder()
            .try_single(seq("$A"))
            .map_err(|e| anyhow::anyhow!("template: {e}"))?
            .try_pair(format!("{} {}", seq("$A"), seq("$B:1")))
            .map_err(|e| anyhow::anyhow!("template: {e}"))?
            .special_tokens(specials)
            .build()
            .map_err(|e| anyhow::anyhow!("template: {e}"))?
            .into())
    }

    /// `tokenizer_config.json` for Transformers (`PreTrainedTokenizerFast` reading tokenizer.json).
    pub fn tokenizer_config(&self, model_max_length: usize) -> serde_json::Value {
        let mut decoder = serde_json::Map::new();
        for (id, content, special) in self.added() {
            decoder.insert(
                id.to_string(),
                serde_json::json!({
                    "content": content, "lstrip": false, "normalized": false,
                    "rstrip": false, "single_word": false, "special": special
                }),
            );
        }
        let mut v = serde_json::json!({
            "add_bos_token": self.add_bos,
            "add_eos_token": self.add_eos,
            "added_tokens_decoder": decoder,
            "clean_up_tokenization_spaces": false,
            "model_max_length": model_max_length,
            "tokenizer_class": "PreTrainedTokenizerFast",
        });
        for (key, id) in [
            ("bos_token", self.bos),
            ("eos_token", self.eos),
            ("unk_token", self.unk),
            ("pad_token", self.pad),
        ] {
            if let Some(t) = self.token(id) {
                v[key] = t.into();
            }
        }
        if let Some(t) = &self.chat_template {
            v["chat_template"] = t.clone().into();
        }
        v
    }
}

/// Text with the cases a byte-level BPE must survive: contractions, digits, punctuation,
/// runs of spaces and newlines, tabs, accents, CJK and an emoji.
pub const ROUND_TRIP_SAMPLE: &str = "Hello world! It's 2024: the year's 1,234.5 results aren't in.\n\n\
    \tIndented  line with   spaces   \nCafé naïve façade — “quotes” ‘too’\n中文文本，日本語のテキスト 🙂\n\
    def f(x):\n    return x ** 2  # comment\n";

/// Checks that `tok` encodes and decodes `text` without loss.
pub fn check_round_trip(tok: &Tokenizer, text: &str) -> Result<()> {
    let enc = tok
        .encode(text, false)
        .map_err(|e| anyhow::anyhow!("the rebuilt tokenizer cannot encode text: {e}"))?;
    let back = tok
        .decode(enc.get_ids(), false)
        .map_err(|e| anyhow::anyhow!("the rebuilt tokenizer cannot decode: {e}"))?;
    if back != text {
        bail!("the rebuilt tokenizer is lossy: {text:?} came back as {back:?}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A byte-level vocabulary: the 256 byte symbols, a few merges, and two control tokens.
    fn toy() -> GgufVocab {
        let bytes = tokenizers::pre_tokenizers::byte_level::ByteLevel::alphabet();
        let mut symbols: Vec<String> = bytes.into_iter().map(|c| c.to_string()).collect();
        symbols.sort();
        let mut tokens = vec!["<|endoftext|>".to_string(), "<|im_start|>".to_string()];
        tokens.extend(symbols);
        let merges = [
            "h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d", "4 2",
        ];
        for m in merges {
            tokens.push(m.replace(' ', ""));
        }
        let mut types = vec![TOKEN_NORMAL; tokens.len()];
        types[0] = TOKEN_CONTROL;
        types[1] = TOKEN_CONTROL;
        GgufVocab {
            model: "gpt2".into(),
            pre: Some("smollm".into()),
            types,
            merges: merges.iter().map(|s| s.to_string()).collect(),
            bos: Some(1),
            eos: Some(0),
            tokens,
            ..Default::default()
        }
    }

    #[test]
    fn the_merges_and_the_digit_split_apply() {
        let v = toy();
        let tok = v.build().unwrap();
        let id = |t: &str| v.tokens.iter().position(|x| x == t).unwrap() as u32;
        let enc = tok.encode("hello world 42", false).unwrap();
        assert_eq!(
            enc.get_ids(),
            &[id("hello"), id("Ġworld"), id("Ġ"), id("4"), id("2")]
        );
        let enc = tok.encode("<|im_start|>hello", false).unwrap();
        assert_eq!(enc.get_ids(), &[1, id("hello")]);
        check_round_trip(&tok, ROUND_TRIP_SAMPLE).unwrap();
        let mut g = v.clone();
        g.pre = Some("gpt2".into());
        // Without the digit split, " 42" is one pre-token and "4 2" merges.
        let enc = g.build().unwrap().encode(" 42", false).unwrap();
        assert_eq!(enc.get_ids(), &[id("Ġ"), id("42")]);
    }

    #[test]
    fn bos_is_added_when_the_file_says_so() {
        let mut v = toy();
        v.add_bos = true;
        let tok = v.build().unwrap();
        let enc = tok.encode("hello", true).unwrap();
        assert_eq!(enc.get_ids()[0], 1);
        let cfg = v.tokenizer_config(512);
        assert_eq!(cfg["bos_token"], "<|im_start|>");
        assert_eq!(cfg["added_tokens_decoder"]["0"]["special"], true);
    }

    #[test]
    fn unknown_models_and_pre_tokenizers_are_refused() {
        let mut v = toy();
        v.pre = Some("deepseek-llm".into());
        let e = format!("{:#}", v.build().unwrap_err());
        assert!(
            e.contains("\"deepseek-llm\"") && e.contains("smollm"),
            "{e}"
        );
        v.model = "llama".into();
        let e = format!("{:#}", v.build().unwrap_err());
        assert!(e.contains("tokenizer.ggml.model is \"llama\""), "{e}");
        let mut v = toy();
        v.merges.push("q z".into());
        let e = format!("{:#}", v.build().unwrap_err());
        assert!(e.contains("\"q z\""), "{e}");
    }
}
