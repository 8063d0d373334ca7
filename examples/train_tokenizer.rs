//! Trains the byte-level BPE tokenizer the repo ships (examples/tiny-sala/tokenizer.json).
//!
//! cargo run --release --example train_tokenizer -- OUT.json VOCAB FILE...
//!
//! Special tokens mirror MiniCPM's first ids: <unk>=0, <s>=1, </s>=2, then the ChatML markers.

use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::normalizers::NormalizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::processors::PostProcessorWrapper;
use tokenizers::{AddedToken, TokenizerBuilder};

fn main() -> tokenizers::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() < 3 {
        eprintln!("usage: train_tokenizer OUT.json VOCAB FILE...");
        std::process::exit(2);
    }
    let vocab: usize = args[1].parse()?;
    let specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"];
    let mut trainer = BpeTrainerBuilder::new()
        .vocab_size(vocab)
        .min_frequency(2)
        .show_progress(false)
        .special_tokens(
            specials
                .iter()
                .map(|s| AddedToken::from(*s, true))
                .collect(),
        )
        .initial_alphabet(
            ByteLevel::alphabet()
                .into_iter()
                .collect::<std::collections::HashSet<char>>(),
        )
        .build();
    let byte_level = ByteLevel::default().add_prefix_space(false);
    let mut tokenizer = TokenizerBuilder::<
        BPE,
        NormalizerWrapper,
        PreTokenizerWrapper,
        PostProcessorWrapper,
        DecoderWrapper,
    >::new()
    .with_model(BPE::default())
    .with_pre_tokenizer(Some(byte_level.into()))
    .with_post_processor(Some(byte_level.into()))
    .with_decoder(Some(byte_level.into()))
    .build()?;
    tokenizer.train_from_files(&mut trainer, args[2..].to_vec())?;
    tokenizer.save(&args[0], true)?;
    eprintln!(
        "wrote {} ({} tokens)",
        args[0],
        tokenizer.get_vocab_size(true)
    );
    Ok(())
}
