//! Property tests of the page lifecycle: random sequences of reserve / grant / write / verify /
//! abort / finish against two pools.
//!
//! After every step: page counts add up; every live writer's pages are still owned by its
//! request and not free; no rejected request owns a page. At the end, with every value
//! dropped: free == total. A readable handle appears only after a matching manifest.

// Test sizes are small; truncating casts cannot happen here.
#![allow(clippy::cast_possible_truncation)]

use libkv::admission::{self, Limits, RequestSpec};
use libkv::config::{PoisonMode, Scrub};
use libkv::model::{ModelRunner, ReferenceModel};
use libkv::pool::{PagePool, PageState, PoolOptions, Reservation, WriteGrant};
use libkv::verify::{Manifest, VerifiedKv, page_digest};
use libkv::{Dtype, Generation, Owner, PageGeometry, RequestId};
use proptest::prelude::*;

fn geometry() -> PageGeometry {
    PageGeometry {
        tokens_per_page: 4,
        layers: 1,
        kv_heads: 1,
        head_dim: 8,
        dtype: Dtype::Bf16,
    }
}

#[derive(Clone, Debug)]
enum Op {
    Admit { prompt: u32, max_new: u32 },
    Grant(usize),
    Prefill(usize),
    DropGrant(usize),
    Verify(usize, Forge),
    Abort(usize),
    Append(usize),
    Finish(usize),
}

#[derive(Clone, Copy, Debug)]
enum Forge {
    None,
    FewerTokens,
    FewerPages,
    WrongOwner,
    BadDigest,
}

fn op() -> impl Strategy<Value = Op> {
    let forge = prop_oneof![
        4 => Just(Forge::None),
        1 => Just(Forge::FewerTokens),
        1 => Just(Forge::FewerPages),
        1 => Just(Forge::WrongOwner),
        1 => Just(Forge::BadDigest),
    ];
    prop_oneof![
        3 => (0u32..48, 0u32..12).prop_map(|(prompt, max_new)| Op::Admit { prompt, max_new }),
        2 => any::<usize>().prop_map(Op::Grant),
        3 => any::<usize>().prop_map(Op::Prefill),
        2 => any::<usize>().prop_map(Op::DropGrant),
        3 => (any::<usize>(), forge).prop_map(|(i, f)| Op::Verify(i, f)),
        1 => any::<usize>().prop_map(Op::Abort),
        2 => any::<usize>().prop_map(Op::Append),
        1 => any::<usize>().prop_map(Op::Finish),
    ]
}

struct Live {
    owner: Owner,
    prompt: Vec<u32>,
    max_new: u32,
    /// Decode-side reservation (the prefill one is held beside it).
    decode: Option<Reservation>,
    prefill: Option<Reservation>,
    /// Grant on the decode pages (the transfer's writer).
    grant: Option<WriteGrant>,
    /// Digests of the pages as prefill wrote them, when written.
    written: Option<Vec<u32>>,
    verified: Option<VerifiedKv>,
}

fn check_counts(pool: &PagePool) {
    let u = pool.usage();
    assert_eq!(
        u.free + u.reserved + u.writing + u.readable + u.draining,
        u.total,
        "{u:?}"
    );
}

fn check_writers(pool: &PagePool, grants: &[&WriteGrant]) {
    for g in grants {
        for &p in g.pages() {
            let (state, owner) = pool.page_state(p).unwrap();
            assert!(
                matches!(state, PageState::Writing | PageState::Draining),
                "{p} has a live writer but is {state:?}"
            );
            assert_eq!(
                owner,
                Some(g.owner()),
                "{p} has a live writer of another owner"
            );
        }
    }
}

fn owned_by(pool: &PagePool, owner: Owner) -> usize {
    (0..pool.pages())
        .filter(|&i| pool.page_state(libkv::PageId(i)).unwrap().1 == Some(owner))
        .count()
}

fn run(ops: Vec<Op>, poison: PoisonMode) {
    let g = geometry();
    let opts = PoolOptions {
        poison,
        scrub: Scrub::Off,
    };
    let prefill = PagePool::host(c"p", g, 12, opts).unwrap();
    let decode = PagePool::host(c"d", g, 16, opts).unwrap();
    let limits = Limits {
        geometry: g,
        max_context: 40,
        max_new_tokens: 8,
        prefill_pages: 12,
        decode_pages: 16,
    };
    let model = ReferenceModel::new(g).unwrap();
    let mut live: Vec<Live> = Vec::new();
    let mut orphans: Vec<WriteGrant> = Vec::new();
    let mut next = 1u64;
    for op in ops {
        match op {
            Op::Admit { prompt, max_new } => {
                let owner = Owner {
                    request: RequestId(next),
                    generation: Generation(1),
                };
                next += 1;
                let spec = RequestSpec {
                    tenant: "t".into(),
                    prompt_tokens: prompt,
                    max_new_tokens: max_new,
                };
                match admission::admit(spec, &limits, owner, &prefill, &decode) {
                    Ok(a) => {
                        let text: Vec<u32> =
                            (0..prompt).map(|i| (i * 7 + next as u32) & 0xFF).collect();
                        live.push(Live {
                            owner,
                            prompt: text,
                            max_new,
                            decode: Some(a.decode),
                            prefill: Some(a.prefill),
                            grant: None,
                            written: None,
                            verified: None,
                        });
                    }
                    Err(rej) => {
                        // Rejection is terminal: nothing of it is left anywhere.
                        assert_eq!(
                            owned_by(&prefill, owner),
                            0,
                            "rejected {owner} holds prefill pages: {rej}"
                        );
                        assert_eq!(
                            owned_by(&decode, owner),
                            0,
                            "rejected {owner} holds decode pages: {rej}"
                        );
                    }
                }
            }
            Op::Grant(i) if !live.is_empty() => {
                let n = live.len();
                let l = &mut live[i % n];
                if let (Some(d), None) = (l.decode.as_mut(), l.grant.as_ref())
                    && let Ok(gr) = d.grant_write()
                {
                    l.grant = Some(gr);
                }
            }
            Op::Prefill(i) if !live.is_empty() => {
                let n = live.len();
                let l = &mut live[i % n];
                if let Some(gr) = l.grant.as_mut() {
                    model.prefill(&l.prompt, gr).unwrap();
                    let digests = (0..gr.pages().len())
                        .map(|k| page_digest(gr.page_mut(k).unwrap()))
                        .collect();
                    l.written = Some(digests);
                }
            }
            Op::DropGrant(i) if !live.is_empty() => {
                let n = live.len();
                let l = &mut live[i % n];
                l.grant = None;
            }
            Op::Verify(i, forge) if !live.is_empty() => {
                let idx = i % live.len();
                let l = &mut live[idx];
                let Some(d) = l.decode.take() else { continue };
                let digests = l
                    .written
                    .clone()
                    .unwrap_or_else(|| vec![0; d.prompt_pages()]);
                let mut m = Manifest {
                    owner: l.owner,
                    tokens: d.tokens(),
                    pages: d.pages()[..d.prompt_pages()].to_vec(),
                    digests,
                };
                match forge {
                    Forge::None => {}
                    Forge::FewerTokens => m.tokens = m.tokens.saturating_sub(1),
                    Forge::FewerPages => {
                        m.pages.pop();
                        m.digests.pop();
                    }
                    Forge::WrongOwner => m.owner.request = RequestId(m.owner.request.0 + 1000),
                    Forge::BadDigest => {
                        if let Some(x) = m.digests.first_mut() {
                            *x ^= 1;
                        }
                    }
                }
                let honest =
                    matches!(forge, Forge::None) && l.written.is_some() && l.grant.is_none();
                let changes_nothing = matches!(
                    forge,
                    Forge::FewerTokens | Forge::FewerPages | Forge::BadDigest
                ) && m.tokens == d.tokens()
                    && m.pages.len() == d.prompt_pages()
                    && m.digests == l.written.clone().unwrap_or_default();
                match d.verify(&m) {
                    Ok(v) => {
                        assert!(
                            honest || (changes_nothing && l.written.is_some() && l.grant.is_none()),
                            "verified without coverage: forge {forge:?}, written {}, grant {}",
                            l.written.is_some(),
                            l.grant.is_some()
                        );
                        l.verified = Some(v);
                    }
                    Err(_) => {
                        assert!(!honest, "honest manifest refused");
                        // Fail closed: the request is over. Its prefill side goes too.
                        let mut gone = live.remove(idx);
                        if let Some(g) = gone.grant.take() {
                            orphans.push(g);
                        }
                        drop(gone);
                    }
                }
            }
            Op::Abort(i) if !live.is_empty() => {
                let idx = i % live.len();
                let mut gone = live.remove(idx);
                if let Some(g) = gone.grant.take() {
                    orphans.push(g);
                }
                drop(gone);
            }
            Op::Append(i) if !live.is_empty() => {
                let n = live.len();
                let l = &mut live[i % n];
                if let Some(v) = l.verified.as_mut() {
                    let before = v.tokens();
                    let cap = u64::from(l.prompt.len() as u32 + l.max_new);
                    let r = v.append(|page, slot| model.write_token(page, slot, 1, before));
                    assert_eq!(
                        r.is_ok(),
                        before < cap,
                        "append at {before} of capacity {cap}"
                    );
                }
            }
            Op::Finish(i) if !live.is_empty() => {
                let idx = i % live.len();
                if live[idx].verified.is_some() {
                    let mut gone = live.remove(idx);
                    gone.prefill = None;
                    gone.verified.take().unwrap().finish();
                }
            }
            _ => {}
        }
        // Orphaned writers end at some point: drop the oldest now and then.
        if orphans.len() > 2 {
            orphans.remove(0);
        }
        check_counts(&prefill);
        check_counts(&decode);
        let grants: Vec<&WriteGrant> = live
            .iter()
            .filter_map(|l| l.grant.as_ref())
            .chain(orphans.iter())
            .collect();
        check_writers(&decode, &grants);
        // Draining pages exist only while an orphaned writer does.
        let u = decode.usage();
        let orphan_pages: usize = orphans.iter().map(|g| g.pages().len()).sum();
        assert_eq!(
            u.draining as usize, orphan_pages,
            "draining pages without a writer"
        );
    }
    drop(live);
    drop(orphans);
    for pool in [&prefill, &decode] {
        let u = pool.usage();
        assert_eq!(u.free, u.total, "pages leaked: {u:?}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn lifecycle_never_leaks_or_frees_under_a_writer(ops in proptest::collection::vec(op(), 1..60)) {
        run(ops, PoisonMode::Off);
    }

    #[test]
    fn lifecycle_with_poison(ops in proptest::collection::vec(op(), 1..60)) {
        run(ops, PoisonMode::Owner);
    }
}

/// `read_page` serves only the reservation's own pages, and none while a writer holds them.
#[test]
fn read_page_is_limited_to_owned_idle_pages() {
    let g = geometry();
    let pool = PagePool::host(c"kvtest-read", g, 8, PoolOptions::default()).unwrap();
    let owner = |r| Owner {
        request: RequestId(r),
        generation: Generation(1),
    };
    let mut a = pool.reserve(owner(1), 8, 8).unwrap();
    let b = pool.reserve(owner(2), 8, 8).unwrap();
    {
        let mut grant = a.grant_write().unwrap();
        grant.page_mut(0).unwrap().fill(0xab);
        let page = grant.pages()[0];
        drop(grant);
        assert!(a.read_page(page).unwrap().iter().all(|&x| x == 0xab));
    }
    let other = b.pages()[0];
    assert_eq!(
        a.read_page(other).unwrap_err(),
        libkv::pool::PoolError::NotOwned { page: other }
    );
    assert!(!a.has_writer());
    let grant = a.grant_write().unwrap();
    assert_eq!(
        a.read_page(a.pages()[0]).unwrap_err(),
        libkv::pool::PoolError::WriterActive
    );
    drop(grant);
    assert_eq!(
        a.read_page(a.pages()[1]).unwrap().len(),
        g.bytes_per_page() as usize
    );
}
