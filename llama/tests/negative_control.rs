//! Negative controls for the real model: decode really reads the transferred pages, and
//! verification catches a page altered after prefill wrote it.
//!
//! The same alteration (one V vector of the first prompt page made huge) is applied twice:
//! to a decode reservation's pages before `verify`, which must refuse them, and to pages in
//! plain memory that a harness decodes from without any verification, whose output must
//! differ from the unaltered run. Needs the model file (`scripts/fetch-model`); without it
//! the test says so and passes, except under CI (`CI` set).

use libkv::config::{PoisonMode, Scrub};
use libkv::model::{KvRead, MemoryKv, PageWrite, decode, monolithic_paged};
use libkv::pool::{PagePool, PoolOptions};
use libkv::proto::Sampling;
use libkv::verify::{Manifest, VerifyError, page_digest};
use libkv::{Dtype, Generation, Kv, Owner, RequestId};
use llama::chat::Message;

const MAX_NEW: u32 = 8;

/// Makes V of layer 0, head 0, slot 0 of `page` huge: a value attention cannot ignore.
fn alter(g: &libkv::PageGeometry, page: &mut [u8]) {
    let at = g.vector_offset(0, Kv::V, 0, 0);
    let len = g.head_dim as usize * g.dtype.size();
    for b in &mut page[at..at + len] {
        *b = 0x47;
    }
}

#[test]
fn an_altered_page_is_refused_and_without_verification_it_changes_the_output() {
    let path = llama::gguf::default_model_path();
    if !path.is_file() {
        assert!(
            std::env::var_os("CI").is_none(),
            "{} is missing",
            path.display()
        );
        eprintln!(
            "SKIPPED: {} is missing (scripts/fetch-model)",
            path.display()
        );
        return;
    }
    let g = llama::load::model_geometry(&path, 16, Dtype::Bf16).unwrap();
    let model = llama::load::load_gguf(&path, g, 2).unwrap();
    let runner = model.runner.as_ref();
    let prompt = model
        .encode_chat(&[Message::user("Name the capital city of France.")])
        .unwrap();
    let n = u32::try_from(prompt.len()).unwrap();
    let last = *prompt.last().unwrap();
    let want = monolithic_paged(runner, &prompt, MAX_NEW, &Sampling::GREEDY).unwrap();
    assert!(
        model.decode(&want.tokens).contains("Paris"),
        "{:?}",
        model.decode(&want.tokens)
    );

    let pool = PagePool::host(
        c"kvneg",
        g,
        32,
        PoolOptions {
            poison: PoisonMode::Owner,
            scrub: Scrub::Off,
        },
    )
    .unwrap();
    let run = |request: u64, tamper: bool| {
        let owner = Owner {
            request: RequestId(request),
            generation: Generation(1),
        };
        let mut res = pool.reserve(owner, n, u64::from(n + MAX_NEW)).unwrap();
        let mut grant = res.grant_write().unwrap();
        runner.prefill(&prompt, &mut grant).unwrap();
        // The manifest prefill would send: digests of the pages as it wrote them.
        let pages = res.prompt_pages();
        let digests: Vec<u32> = (0..pages)
            .map(|i| page_digest(grant.page_mut(i).unwrap()))
            .collect();
        if tamper {
            alter(&g, grant.page_mut(0).unwrap());
        }
        drop(grant);
        let manifest = Manifest {
            owner,
            tokens: n,
            pages: res.pages()[..pages].to_vec(),
            digests,
        };
        res.verify(&manifest)
    };

    // Honest pages verify, and decode over them equals the monolithic path.
    let mut kv = run(1, false).expect("honest pages verify");
    let out = decode(runner, &mut kv, n, last, MAX_NEW, |_, _| {}).unwrap();
    assert_eq!(
        out, want,
        "decode over verified pages equals the monolithic path"
    );
    drop(kv);

    // The altered page is refused before anything reads it.
    let refused = run(2, true).map(|_| ());
    assert!(
        matches!(refused, Err(VerifyError::Digest { index: 0, .. })),
        "{refused:?}"
    );

    // The control: the same alteration, decoded without verification, changes the output.
    let mut kv = MemoryKv::new(g, u64::from(n), u64::from(MAX_NEW));
    runner.prefill(&prompt, &mut kv).unwrap();
    alter(&g, kv.page_mut(0).unwrap());
    kv.set_prefilled(u64::from(n));
    assert_eq!(kv.positions(), u64::from(n));
    let tampered = decode(runner, &mut kv, n, last, MAX_NEW, |_, _| {}).unwrap();
    assert_ne!(
        tampered.tokens,
        want.tokens,
        "decode ignored the altered page: {:?}",
        model.decode(&tampered.tokens)
    );
}
