//! Exhaustive model check of the request / page lifecycle against the real libkv code.
//!
//! A breadth-first search over every sequence of actions up to a depth bound, on two small
//! real pools (prefill and decode, host memfds) and a few requests. Every state is reached by
//! replaying its action sequence from scratch on fresh pools (the code is deterministic), so
//! the search drives `admission::admit`, `Reservation`, `WriteGrant` and `Reservation::verify`
//! themselves: nothing here re-implements them.
//!
//! States are deduplicated by an abstract fingerprint: per page of both pools its state and
//! owner, per request its phase (plus whether its reservation ever had a grant, since the
//! reservation keeps a hidden `grant_live` flag). The search is therefore complete over the
//! distinct abstract states reachable within the bound. What the fingerprint leaves out and
//! why it is sound to merge on it:
//!
//! - the order of the pool's free stack: it only decides which page ids the next reservation
//!   gets, and all pages are interchangeable (page ids are in the fingerprint anyway);
//! - the bytes of pages that are not written under the current reservation: an honest
//!   manifest's digests depend on the owner, so stale bytes of another owner (or zeros)
//!   never match it whatever they are.
//!
//! Actions: `Admit(req, size)` (sizes that fit, that fill a pool, that can never fit),
//! `Grant` (also while a grant is live: refused), `Write` (prefill the granted pages
//! honestly, also through an orphaned grant), `DropGrant`, `Verify` with an honest, a short
//! (one token fewer) or a wrong-digest manifest, `Abort` (drops the reservations, possibly
//! while a grant is alive) and `Finish` (drops the verified handle).
//!
//! Invariants checked in every reached state:
//!
//! 1. a page is `Readable` only if its owner holds a `VerifiedKv` obtained with an honest
//!    manifest over pages it had written, and the page is one of its prompt pages; reading
//!    through the `VerifiedKv` gives exactly the honest bytes;
//! 2. every page covered by a live `WriteGrant` is `Writing` (reservation alive) or
//!    `Draining` (reservation gone), owned by the grant's owner: never `Free`, never another
//!    request's;
//! 3. a rejected (or not yet admitted) request owns no page in either pool;
//! 4. page counts add up: the per-state counts of the table equal `usage()`, and sum to the
//!    total; a request holds exactly the pages it needs while admitted, and only the pages
//!    of its live grant once it is gone;
//! 5. after dropping every reservation and handle only pages under a live grant remain
//!    (`Draining`), and after dropping the grants every page is `Free`.
//!
//! Transitions are checked too: admission succeeds exactly when both pools have the pages,
//! an honest manifest over written pages with no writer is accepted, and refusals carry the
//! expected `VerifyError` variant.
//!
//! `KVFENCE_MC_DEPTH` overrides the depth bound of the search; `KVFENCE_MC_SAFETY_ONLY=1` skips
//! the exact-refusal-reason checks (see [`safety_only`]).

// Test sizes are tiny; truncating casts cannot happen here.
#![allow(clippy::cast_possible_truncation)]

use libkv::admission::{self, Limits, RequestSpec};
use libkv::config::{PoisonMode, Scrub};
use libkv::pool::{PagePool, PageState, PoolError, PoolOptions, Reservation, WriteGrant};
use libkv::verify::{Manifest, VerifiedKv, VerifyError, page_digest};
use libkv::{Dtype, Generation, Owner, PageGeometry, PageId, RequestId};
use std::collections::HashSet;
use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::Instant;

/// Tokens per page 2; a page is 64 bytes.
fn geometry() -> PageGeometry {
    PageGeometry {
        tokens_per_page: 2,
        layers: 1,
        kv_heads: 1,
        head_dim: 4,
        dtype: Dtype::F32,
    }
}

/// One configuration of the search.
#[derive(Clone, Copy, Debug)]
struct Config {
    requests: usize,
    prefill_pages: u32,
    decode_pages: u32,
    sizes: &'static [Size],
    poison: PoisonMode,
}

impl Config {
    fn limits(&self) -> Limits {
        Limits {
            geometry: geometry(),
            max_context: 8,
            max_new_tokens: 6,
            prefill_pages: self.prefill_pages,
            decode_pages: self.decode_pages,
        }
    }
}

/// Request sizes (prompt tokens, max new tokens), with 2 tokens per page.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Size {
    /// 1 + 1 tokens: 1 prefill page, 1 decode page.
    S,
    /// 3 + 1 tokens: 2 prefill pages, 2 decode pages (two of them overflow a 3-page prefill
    /// pool after the decode side was reserved: both or neither).
    M,
    /// 2 + 5 tokens: 1 prefill page, 4 decode pages.
    L,
    /// 4 + 6 tokens: 5 decode pages, more than the pool has: can never fit.
    X,
}

impl Size {
    fn tokens(self) -> (u32, u32) {
        match self {
            Size::S => (1, 1),
            Size::M => (3, 1),
            Size::L => (2, 5),
            Size::X => (4, 6),
        }
    }
}

/// How a manifest given to `verify` is made.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Forge {
    /// Owner, tokens, pages and the digests of the honest contents.
    Honest,
    /// One token fewer than reserved (pages and digests unchanged).
    Short,
    /// The first digest flipped.
    BadDigest,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Action {
    Admit(usize, Size),
    Grant(usize),
    Write(usize),
    DropGrant(usize),
    Verify(usize, Forge),
    Abort(usize),
    Finish(usize),
}

/// Abstract phase of one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Phase {
    New,
    Rejected,
    /// Both reservations alive, not verified.
    Reserved {
        grant: bool,
        written: bool,
        granted_before: bool,
    },
    /// Decode side verified (the prefill reservation is still held).
    Verified,
    /// Aborted, refused or finished; `grant` if its writer is still alive (orphaned).
    Gone {
        grant: bool,
    },
}

/// One request of the harness and the real values it holds.
struct Req {
    owner: Owner,
    phase: Phase,
    size: Option<Size>,
    prefill: Option<Reservation>,
    decode: Option<Reservation>,
    grant: Option<WriteGrant>,
    verified: Option<VerifiedKv>,
    /// The decode reservation's pages and how many of them hold the prompt.
    decode_pages: Vec<PageId>,
    prompt_pages: usize,
    /// The manifest `verified` was obtained with was honest and the pages were written.
    verified_honest: bool,
}

struct World {
    cfg: Config,
    prefill: PagePool,
    decode: PagePool,
    reqs: Vec<Req>,
}

/// A failed check: what failed and after which actions.
#[derive(Debug)]
struct Violation {
    trace: Vec<Action>,
    what: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "counterexample after {} actions:", self.trace.len())?;
        for (i, a) in self.trace.iter().enumerate() {
            writeln!(f, "  {:2}. {a:?}", i + 1)?;
        }
        write!(f, "violated: {}", self.what)
    }
}

/// `KVFENCE_MC_SAFETY_ONLY=1`: skip the checks of exact refusal reasons, so that a weakened
/// check shows its first *safety* counterexample (a state invariant) rather than the first
/// refusal with an unexpected reason.
fn safety_only() -> bool {
    static ONCE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ONCE.get_or_init(|| std::env::var_os("KVFENCE_MC_SAFETY_ONLY").is_some_and(|v| v == "1"))
}

/// Honest contents of page `k` of request `r`: differ per owner and per page.
fn honest_page(r: usize, k: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|j| ((r + 1) * 0x40 + k * 0x10 + (j % 16)) as u8)
        .collect()
}

fn owner_of(r: usize) -> Owner {
    Owner {
        request: RequestId(r as u64 + 1),
        generation: Generation(1),
    }
}

impl World {
    fn new(cfg: Config) -> World {
        let opts = PoolOptions {
            poison: cfg.poison,
            scrub: Scrub::Off,
        };
        let g = geometry();
        let prefill = PagePool::host(c"mc-prefill", g, cfg.prefill_pages, opts).unwrap();
        let decode = PagePool::host(c"mc-decode", g, cfg.decode_pages, opts).unwrap();
        let reqs = (0..cfg.requests)
            .map(|r| Req {
                owner: owner_of(r),
                phase: Phase::New,
                size: None,
                prefill: None,
                decode: None,
                grant: None,
                verified: None,
                decode_pages: Vec::new(),
                prompt_pages: 0,
                verified_honest: false,
            })
            .collect();
        World {
            cfg,
            prefill,
            decode,
            reqs,
        }
    }

    /// Actions that mean something in this state, in a fixed order.
    fn enabled(&self) -> Vec<Action> {
        let mut out = Vec::new();
        for (r, q) in self.reqs.iter().enumerate() {
            match q.phase {
                Phase::New => out.extend(self.cfg.sizes.iter().map(|&s| Action::Admit(r, s))),
                Phase::Rejected => {}
                Phase::Reserved { grant, .. } => {
                    out.push(Action::Grant(r));
                    if grant {
                        out.push(Action::Write(r));
                        out.push(Action::DropGrant(r));
                    }
                    for f in [Forge::Honest, Forge::Short, Forge::BadDigest] {
                        out.push(Action::Verify(r, f));
                    }
                    out.push(Action::Abort(r));
                }
                Phase::Verified => {
                    out.push(Action::Abort(r));
                    out.push(Action::Finish(r));
                }
                Phase::Gone { grant } => {
                    if grant {
                        out.push(Action::Write(r));
                        out.push(Action::DropGrant(r));
                    }
                }
            }
        }
        out
    }

    /// Runs one action on the real code and checks its immediate result.
    fn step(&mut self, a: Action) -> Result<(), String> {
        let page_bytes = self.decode.page_bytes();
        match a {
            Action::Admit(r, size) => {
                let (prompt, max_new) = size.tokens();
                let g = geometry();
                let need_d = g.pages_for_tokens(u64::from(prompt + max_new)) as u32;
                let need_p = g.pages_for_tokens(u64::from(prompt)) as u32;
                let fits = need_d <= self.decode.usage().free
                    && need_p <= self.prefill.usage().free
                    && admission::need(
                        &RequestSpec {
                            tenant: "t".into(),
                            prompt_tokens: prompt,
                            max_new_tokens: max_new,
                        },
                        &self.cfg.limits(),
                    )
                    .is_ok();
                let spec = RequestSpec {
                    tenant: "t".into(),
                    prompt_tokens: prompt,
                    max_new_tokens: max_new,
                };
                let q = &mut self.reqs[r];
                q.size = Some(size);
                let limits = self.cfg.limits();
                match admission::admit(spec, &limits, q.owner, &self.prefill, &self.decode) {
                    Ok(adm) => {
                        if !fits {
                            return Err(format!("admitted {size:?} although it does not fit"));
                        }
                        if adm.decode.pages().len() != need_d as usize
                            || adm.prefill.pages().len() != need_p as usize
                        {
                            return Err(format!(
                                "admitted with {} decode / {} prefill pages, need {need_d} / {need_p}",
                                adm.decode.pages().len(),
                                adm.prefill.pages().len()
                            ));
                        }
                        q.decode_pages = adm.decode.pages().to_vec();
                        q.prompt_pages = adm.decode.prompt_pages();
                        q.decode = Some(adm.decode);
                        q.prefill = Some(adm.prefill);
                        q.phase = Phase::Reserved {
                            grant: false,
                            written: false,
                            granted_before: false,
                        };
                    }
                    Err(rej) => {
                        if fits {
                            return Err(format!("{size:?} fits but was rejected: {rej}"));
                        }
                        q.phase = Phase::Rejected;
                    }
                }
            }
            Action::Grant(r) => {
                let q = &mut self.reqs[r];
                let Phase::Reserved {
                    grant,
                    written,
                    granted_before: _,
                } = q.phase
                else {
                    unreachable!()
                };
                let res = q.decode.as_mut().unwrap().grant_write();
                match (grant, res) {
                    (true, Err(PoolError::WriterActive)) => {}
                    (true, other) => {
                        return Err(format!("second live grant: {other:?}"));
                    }
                    (false, Ok(g)) => {
                        if g.owner() != q.owner || g.pages() != &q.decode_pages[..q.prompt_pages] {
                            return Err(format!("grant of {:?} over {:?}", g.owner(), g.pages()));
                        }
                        q.grant = Some(g);
                        q.phase = Phase::Reserved {
                            grant: true,
                            written,
                            granted_before: true,
                        };
                    }
                    (false, Err(e)) => return Err(format!("first grant refused: {e}")),
                }
            }
            Action::Write(r) => {
                let q = &mut self.reqs[r];
                let g = q.grant.as_mut().unwrap();
                for k in 0..g.pages().len() {
                    let page = g.page_mut(k).map_err(|e| format!("page_mut({k}): {e}"))?;
                    page.copy_from_slice(&honest_page(r, k, page_bytes));
                }
                if let Phase::Reserved {
                    grant,
                    granted_before,
                    ..
                } = q.phase
                {
                    q.phase = Phase::Reserved {
                        grant,
                        written: true,
                        granted_before,
                    };
                }
            }
            Action::DropGrant(r) => {
                let q = &mut self.reqs[r];
                q.grant = None;
                q.phase = match q.phase {
                    Phase::Reserved {
                        written,
                        granted_before,
                        ..
                    } => Phase::Reserved {
                        grant: false,
                        written,
                        granted_before,
                    },
                    Phase::Gone { .. } => Phase::Gone { grant: false },
                    p => p,
                };
            }
            Action::Verify(r, forge) => {
                let q = &mut self.reqs[r];
                let Phase::Reserved { grant, written, .. } = q.phase else {
                    unreachable!()
                };
                let d = q.decode.take().unwrap();
                let n = d.prompt_pages();
                let mut m = Manifest {
                    owner: q.owner,
                    tokens: d.tokens(),
                    pages: d.pages()[..n].to_vec(),
                    digests: (0..n)
                        .map(|k| page_digest(&honest_page(r, k, page_bytes)))
                        .collect(),
                };
                match forge {
                    Forge::Honest => {}
                    Forge::Short => m.tokens -= 1,
                    Forge::BadDigest => m.digests[0] ^= 1,
                }
                match d.verify(&m) {
                    Ok(v) => {
                        q.verified_honest = forge == Forge::Honest && written;
                        q.verified = Some(v);
                        q.phase = Phase::Verified;
                    }
                    Err(e) => {
                        let expected = match (forge, grant, written) {
                            (Forge::Short, _, _) => matches!(e, VerifyError::TokenCount { .. }),
                            (_, true, _) => matches!(e, VerifyError::WriterActive),
                            (Forge::BadDigest, false, _) | (Forge::Honest, false, false) => {
                                matches!(e, VerifyError::Digest { index: 0, .. })
                            }
                            (Forge::Honest, false, true) => false,
                        };
                        if !expected && !safety_only() {
                            return Err(format!(
                                "{forge:?} manifest (grant {grant}, written {written}) refused with: {e}"
                            ));
                        }
                        // Fail closed: the request is over, its prefill side goes too.
                        q.prefill = None;
                        q.phase = Phase::Gone {
                            grant: q.grant.is_some(),
                        };
                    }
                }
            }
            Action::Abort(r) => {
                let q = &mut self.reqs[r];
                q.verified = None;
                q.decode = None;
                q.prefill = None;
                q.phase = Phase::Gone {
                    grant: q.grant.is_some(),
                };
            }
            Action::Finish(r) => {
                let q = &mut self.reqs[r];
                q.verified.take().unwrap().finish();
                q.prefill = None;
                q.phase = Phase::Gone {
                    grant: q.grant.is_some(),
                };
            }
        }
        Ok(())
    }

    fn request_of(&self, owner: Owner) -> Result<usize, String> {
        self.reqs
            .iter()
            .position(|q| q.owner == owner)
            .ok_or_else(|| format!("page owned by unknown {owner}"))
    }

    /// Invariants 1 to 4 over the current state.
    fn check(&self) -> Result<(), String> {
        let page_bytes = self.decode.page_bytes();
        for (name, pool, decode_side) in [
            ("prefill", &self.prefill, false),
            ("decode", &self.decode, true),
        ] {
            let mut counts = [0u32; 5];
            let mut owned = vec![0usize; self.reqs.len()];
            for i in 0..pool.pages() {
                let p = PageId(i);
                let (state, owner) = pool.page_state(p).unwrap();
                counts[state as usize] += 1;
                let Some(owner) = owner else {
                    if state != PageState::Free {
                        return Err(format!("{name} {p} is {state:?} with no owner"));
                    }
                    continue;
                };
                if state == PageState::Free {
                    return Err(format!("{name} {p} is Free but owned by {owner}"));
                }
                let r = self.request_of(owner)?;
                owned[r] += 1;
                let q = &self.reqs[r];
                let granted = q.grant.as_ref().is_some_and(|g| g.pages().contains(&p));
                let ok = match (decode_side, state, q.phase) {
                    (false, PageState::Reserved, Phase::Reserved { .. } | Phase::Verified) => true,
                    (false, _, _) => false,
                    (true, PageState::Reserved, Phase::Reserved { .. } | Phase::Verified) => {
                        !granted
                    }
                    (true, PageState::Writing, Phase::Reserved { grant: true, .. }) => granted,
                    (true, PageState::Draining, Phase::Gone { grant: true }) => granted,
                    (true, PageState::Readable, Phase::Verified) => {
                        q.verified_honest && q.decode_pages[..q.prompt_pages].contains(&p)
                    }
                    _ => false,
                };
                if !ok {
                    return Err(format!(
                        "{name} {p} is {state:?}, owner req{r} in {:?} (verified honestly: {}, \
                         under its grant: {granted})",
                        q.phase, q.verified_honest
                    ));
                }
            }
            let u = pool.usage();
            let by_state = [u.free, u.reserved, u.writing, u.readable, u.draining];
            if counts != by_state
                || counts.iter().sum::<u32>() != u.total
                || u.total != pool.pages()
            {
                return Err(format!(
                    "{name} counts {counts:?} (free, reserved, writing, readable, draining) vs usage {u:?}"
                ));
            }
            for (r, q) in self.reqs.iter().enumerate() {
                let (p, n) = q.size.map_or((0, 0), Size::tokens);
                let g = geometry();
                let need = if decode_side {
                    g.pages_for_tokens(u64::from(p + n))
                } else {
                    g.pages_for_tokens(u64::from(p))
                } as usize;
                let want = match q.phase {
                    Phase::New | Phase::Rejected => 0,
                    Phase::Reserved { .. } | Phase::Verified => need,
                    Phase::Gone { .. } if decode_side => {
                        q.grant.as_ref().map_or(0, |g| g.pages().len())
                    }
                    Phase::Gone { .. } => 0,
                };
                if owned[r] != want {
                    return Err(format!(
                        "req{r} ({:?}) owns {} {name} pages, expected {want}",
                        q.phase, owned[r]
                    ));
                }
            }
        }
        for (r, q) in self.reqs.iter().enumerate() {
            if let Some(g) = &q.grant {
                if g.owner() != q.owner {
                    return Err(format!("req{r} holds a grant of {}", g.owner()));
                }
                for &p in g.pages() {
                    let (state, owner) = self.decode.page_state(p).unwrap();
                    if !matches!(state, PageState::Writing | PageState::Draining)
                        || owner != Some(q.owner)
                    {
                        return Err(format!(
                            "{p} under a live grant of req{r} is {state:?} owned by {owner:?}"
                        ));
                    }
                }
            }
            if let Some(v) = &q.verified {
                for k in 0..q.prompt_pages {
                    let bytes = v
                        .page(k)
                        .ok_or(format!("req{r} verified page {k} unreadable"))?;
                    if bytes != honest_page(r, k, page_bytes).as_slice() {
                        return Err(format!("req{r} reads page {k} with bytes it never wrote"));
                    }
                }
            }
        }
        Ok(())
    }

    /// Invariant 5: drop everything but the grants, then the grants.
    fn teardown(mut self) -> Result<(), String> {
        let mut grants = Vec::new();
        for q in &mut self.reqs {
            q.verified = None;
            q.decode = None;
            q.prefill = None;
            grants.extend(q.grant.take());
        }
        for g in &grants {
            for &p in g.pages() {
                let (state, owner) = self.decode.page_state(p).unwrap();
                if state != PageState::Draining || owner != Some(g.owner()) {
                    return Err(format!(
                        "{p} under a live grant of {} is {state:?} owned by {owner:?} once \
                         every reservation is dropped",
                        g.owner()
                    ));
                }
            }
        }
        let granted: u32 = grants.iter().map(|g| g.pages().len() as u32).sum();
        let (p, d) = (self.prefill.usage(), self.decode.usage());
        if p.free != p.total || d.draining != granted || d.free + d.draining != d.total {
            return Err(format!(
                "after dropping all reservations ({granted} pages under live grants): \
                 prefill {p:?}, decode {d:?}"
            ));
        }
        drop(grants);
        let d = self.decode.usage();
        if d.free != d.total {
            return Err(format!("after dropping every grant: decode {d:?}"));
        }
        Ok(())
    }

    /// The abstract fingerprint: (state, owner) per page of both pools, phase per request.
    fn fingerprint(&self) -> Vec<u8> {
        let mut fp = Vec::new();
        for pool in [&self.prefill, &self.decode] {
            for i in 0..pool.pages() {
                let (state, owner) = pool.page_state(PageId(i)).unwrap();
                fp.push(state as u8);
                fp.push(owner.map_or(0, |o| o.request.0 as u8));
            }
        }
        for q in &self.reqs {
            fp.push(match q.phase {
                Phase::New => 0,
                Phase::Rejected => 1,
                Phase::Reserved {
                    grant,
                    written,
                    granted_before,
                } => {
                    2 | u8::from(grant) << 2
                        | u8::from(written) << 3
                        | u8::from(granted_before) << 4
                }
                Phase::Verified => 3,
                Phase::Gone { grant } => 4 | u8::from(grant) << 2,
            });
        }
        fp
    }
}

/// A newly reached state: its fingerprint and the actions enabled in it.
type Reached = (Vec<u8>, Vec<Action>);

/// Replays `trace` from scratch, checks the state it reaches, and tears it down.
fn replay(cfg: Config, trace: &[Action]) -> Result<Reached, Violation> {
    let fail = |what: String| Violation {
        trace: trace.to_vec(),
        what,
    };
    let run = || -> Result<Reached, Violation> {
        let mut w = World::new(cfg);
        for (i, &a) in trace.iter().enumerate() {
            w.step(a).map_err(|what| Violation {
                trace: trace[..=i].to_vec(),
                what,
            })?;
        }
        w.check().map_err(fail)?;
        let reached = (w.fingerprint(), w.enabled());
        w.teardown().map_err(|e| fail(format!("teardown: {e}")))?;
        Ok(reached)
    };
    match catch_unwind(AssertUnwindSafe(run)) {
        Ok(r) => r,
        Err(panic) => {
            let msg = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_default();
            Err(fail(format!("libkv panicked: {msg}")))
        }
    }
}

/// What one search found.
#[derive(Debug)]
struct Stats {
    states: usize,
    transitions: usize,
    depth: usize,
    /// The frontier emptied before the bound: every reachable abstract state was seen.
    closed: bool,
    per_depth: Vec<usize>,
}

/// Breadth-first search from the initial state up to `max_depth` actions.
fn explore(cfg: Config, max_depth: usize) -> Result<Stats, Violation> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let (fp0, enabled0) = replay(cfg, &[])?;
    let mut seen: HashSet<Vec<u8>> = HashSet::from([fp0]);
    let mut frontier: Vec<(Vec<Action>, Vec<Action>)> = vec![(Vec::new(), enabled0)];
    let mut stats = Stats {
        states: 1,
        transitions: 0,
        depth: 0,
        closed: false,
        per_depth: vec![1],
    };
    while stats.depth < max_depth {
        let jobs: Vec<Vec<Action>> = frontier
            .iter()
            .flat_map(|(trace, enabled)| {
                enabled.iter().map(move |&a| {
                    let mut t = trace.clone();
                    t.push(a);
                    t
                })
            })
            .collect();
        if jobs.is_empty() {
            stats.closed = true;
            break;
        }
        stats.transitions += jobs.len();
        let chunk = jobs.len().div_ceil(threads);
        let results: Vec<Result<Reached, Violation>> = std::thread::scope(|s| {
            let handles: Vec<_> = jobs
                .chunks(chunk)
                .map(|c| s.spawn(move || c.iter().map(|t| replay(cfg, t)).collect::<Vec<_>>()))
                .collect();
            handles
                .into_iter()
                .flat_map(|h| h.join().unwrap())
                .collect()
        });
        let mut next = Vec::new();
        for (trace, result) in jobs.into_iter().zip(results) {
            let (fp, enabled) = result?;
            if seen.insert(fp) {
                next.push((trace, enabled));
            }
        }
        stats.depth += 1;
        stats.states += next.len();
        stats.per_depth.push(next.len());
        if next.is_empty() {
            stats.closed = true;
            break;
        }
        frontier = next;
    }
    Ok(stats)
}

fn run(name: &str, cfg: Config, default_depth: usize) {
    let depth = std::env::var("KVFENCE_MC_DEPTH")
        .ok()
        .and_then(|d| d.parse().ok())
        .unwrap_or(default_depth);
    let start = Instant::now();
    match explore(cfg, depth) {
        Ok(s) => eprintln!(
            "model_check {name}: {} distinct abstract states, {} transitions replayed, depth {}{} \
             (new states per depth {:?}), {:.1?}",
            s.states,
            s.transitions,
            s.depth,
            if s.closed {
                " (closed: the last level added no state, the reachable space is exhausted)"
            } else {
                " (bound reached)"
            },
            s.per_depth,
            start.elapsed()
        ),
        Err(v) => {
            eprintln!("model_check {name}: {v}");
            panic!("model check {name} failed: {}", v.what);
        }
    }
}

/// Two requests on a 3-page prefill and a 4-page decode pool, searched until no new state
/// appears: the whole reachable abstract state space.
#[test]
fn two_requests_complete() {
    run(
        "2 requests, 3+4 pages, all sizes",
        Config {
            requests: 2,
            prefill_pages: 3,
            decode_pages: 4,
            sizes: &[Size::S, Size::M, Size::L, Size::X],
            poison: PoisonMode::Off,
        },
        64,
    );
}

/// Three requests on the same pools, searched until no new state appears (depth 16, about
/// 170,000 replays: ~20 s in release, ~40 s in debug on 2 cores); poison on, so freed pages
/// are wiped under the table lock.
#[test]
fn three_requests_complete() {
    run(
        "3 requests, 3+4 pages, all sizes, poison",
        Config {
            requests: 3,
            prefill_pages: 3,
            decode_pages: 4,
            sizes: &[Size::S, Size::M, Size::L, Size::X],
            poison: PoisonMode::Owner,
        },
        64,
    );
}

/// A reservation whose grant was dropped can be granted again (one writer at a time).
#[test]
fn regrant_after_drop() {
    let pool = PagePool::host(c"mc-regrant", geometry(), 2, PoolOptions::default()).unwrap();
    let mut res = pool.reserve(owner_of(0), 2, 2).unwrap();
    let first = res.grant_write().unwrap();
    assert!(
        matches!(res.grant_write(), Err(PoolError::WriterActive)),
        "two live grants"
    );
    drop(first);
    assert!(
        res.grant_write().is_ok(),
        "a dropped grant still blocks the next one"
    );
}
