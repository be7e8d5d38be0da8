//! A model runner for an inference engine that computes and consumes the KV itself (vLLM,
//! through the kvfence connector): prefilld and decoded run inside the engine's processes
//! with an [`EngineRunner`], and everything of kvfence between them stays as it is —
//! admission, reservations, transfers, coverage and digest verification.
//!
//! ```text
//! prefilld thread                 engine (prefill)          decoded thread         engine (decode)
//!  PrefillRun(owner, prompt)
//!  prefill_owned: posts a Job ---> next_job(): runs the
//!   waits (keep_going, deadline)    prompt, deliver(owner,
//!  <------------------------------  prompt, kv)
//!  writes the pages; prefilld
//!  digests them (PrefillDone)
//!                                                    pull, verify coverage
//!                                                    and every digest, then
//!                                                    sample_batch step 0:
//!                                                    copies the verified KV
//!                                                    out, ends with HANDED_OFF
//!                                                              take_verified(owner) ->
//!                                                              copies it into its own
//!                                                              blocks before attention
//! ```
//!
//! Only KV that passed decoded's verification is ever exported: `sample_batch` reads it
//! from the [`VerifiedKv`](crate::verify::VerifiedKv) the batcher hands it. An export is
//! taken once, by the owner it was verified for, and dropped when nobody takes it within
//! its time to live, so no copy outlives its request for long.
//!
//! KV crosses this interface as f32 in one layout, `[layers][K, V][kv_heads][tokens][head_dim]`
//! (outermost first), whatever the page dtype and page size.

use crate::Owner;
use crate::geometry::{Kv, PageGeometry};
use crate::model::{BatchStep, KvCache, ModelError, ModelRunner, PageWrite};
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The token a decode step of an engine runner returns: the KV went to the engine, which
/// generates the tokens itself. A stop token, so decoded ends the request there, emitting
/// nothing.
pub const HANDED_OFF: u32 = u32::MAX;
/// What every engine runner's model id starts with (`engine:vllm:NAME`): kvctld with
/// `[model] kind = "engine"` registers only such workers.
pub const ENGINE_MODEL_PREFIX: &str = "engine:";
/// Most exports kept at once; the oldest goes first beyond it.
pub const MAX_EXPORTS: usize = 1024;
/// How often a waiting prefill looks whether kvctld abandoned it.
const POLL: Duration = Duration::from_millis(5);

/// A prompt the engine is to prefill for `owner`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Job {
    pub owner: Owner,
    pub prompt: Vec<u32>,
}

/// Verified KV for the engine to load: every prompt position, in the interface layout.
#[derive(Clone, Debug)]
pub struct Exported {
    pub prompt_len: u32,
    /// The prompt's last token, which the engine checks against its request.
    pub last_token: u32,
    pub kv: Vec<f32>,
    /// When it was verified and copied out, in microseconds of the Unix epoch (for the
    /// engine's timing of the hand-off, across processes).
    pub unix_us: u64,
    at: Instant,
}

/// What the engine delivered for one prefill: the prompt and its KV, or why it could not.
type Delivery = Result<(Vec<u32>, Vec<f32>), String>;

#[derive(Debug, Default)]
struct State {
    jobs: VecDeque<Job>,
    /// Owners whose prefill waits for the engine.
    waiting: HashSet<Owner>,
    delivered: HashMap<Owner, Delivery>,
    exports: HashMap<Owner, Exported>,
}

/// Errors of the engine's side of the interface.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum EngineError {
    #[error("no prefill of {0} is waiting for KV (abandoned, or never asked)")]
    NotWaiting(Owner),
    #[error("KV of {got} floats for {tokens} tokens; the geometry needs {want}")]
    BadLength {
        got: usize,
        tokens: usize,
        want: usize,
    },
}

/// See the module docs.
#[derive(Debug)]
pub struct EngineRunner {
    geometry: PageGeometry,
    model_id: String,
    vocab: u32,
    /// Longest a prefill waits for the engine's KV (kvctld's prefill deadline also ends it).
    wait: Duration,
    /// How long an export waits to be taken.
    export_ttl: Duration,
    state: Mutex<State>,
    changed: Condvar,
}

impl EngineRunner {
    pub fn new(
        geometry: PageGeometry,
        model_id: String,
        vocab: u32,
        wait: Duration,
        export_ttl: Duration,
    ) -> EngineRunner {
        EngineRunner {
            geometry,
            model_id,
            vocab,
            wait,
            export_ttl,
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Floats of the interface layout for `tokens` positions.
    pub fn kv_len(&self, tokens: usize) -> usize {
        let g = &self.geometry;
        g.layers as usize * 2 * g.kv_heads as usize * tokens * g.head_dim as usize
    }

    /// The next prompt to prefill, waiting at most `timeout`.
    pub fn next_job(&self, timeout: Duration) -> Option<Job> {
        let deadline = Instant::now() + timeout;
        let mut st = self.lock();
        loop {
            if let Some(job) = st.jobs.pop_front() {
                return Some(job);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            st = self
                .changed
                .wait_timeout(st, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// The engine's KV for `owner`'s prompt (which must be the prompt of the job).
    pub fn deliver(&self, owner: Owner, prompt: Vec<u32>, kv: Vec<f32>) -> Result<(), EngineError> {
        let want = self.kv_len(prompt.len());
        if kv.len() != want {
            // The waiting prefill fails rather than waiting out its deadline.
            self.settle(
                owner,
                Err(format!(
                    "the engine delivered {} floats, not {want}",
                    kv.len()
                )),
            )?;
            return Err(EngineError::BadLength {
                got: kv.len(),
                tokens: prompt.len(),
                want,
            });
        }
        self.settle(owner, Ok((prompt, kv)))
    }

    /// The engine could not prefill `owner`'s prompt.
    pub fn fail(&self, owner: Owner, reason: String) -> Result<(), EngineError> {
        self.settle(owner, Err(reason))
    }

    fn settle(&self, owner: Owner, outcome: Delivery) -> Result<(), EngineError> {
        let mut st = self.lock();
        if !st.waiting.contains(&owner) {
            return Err(EngineError::NotWaiting(owner));
        }
        st.delivered.insert(owner, outcome);
        self.changed.notify_all();
        Ok(())
    }

    /// Takes `owner`'s verified KV, once; `None` when there is none (never verified, taken
    /// already, or expired).
    pub fn take_verified(&self, owner: Owner) -> Option<Exported> {
        let mut st = self.lock();
        self.expire(&mut st);
        st.exports.remove(&owner)
    }

    /// Exports waiting to be taken.
    pub fn exports(&self) -> usize {
        self.lock().exports.len()
    }

    fn expire(&self, st: &mut State) {
        let ttl = self.export_ttl;
        st.exports.retain(|_, e| e.at.elapsed() < ttl);
    }

    /// Copies every readable position of `kv` out, in the interface layout.
    fn export(&self, kv: &dyn KvCache) -> Vec<f32> {
        let g = &self.geometry;
        let n = usize::try_from(kv.positions()).unwrap_or(usize::MAX);
        let d = g.head_dim as usize;
        let mut out = vec![0.0f32; self.kv_len(n)];
        let mut at = 0;
        for layer in 0..g.layers {
            for which in [Kv::K, Kv::V] {
                for head in 0..g.kv_heads {
                    for pos in 0..n {
                        kv.read(layer, which, head, pos as u64, &mut out[at..at + d]);
                        at += d;
                    }
                }
            }
        }
        out
    }

    /// Writes the interface-layout `kv` of `tokens` positions into `pages`, zeroing the slots
    /// past the last token.
    fn write_pages(
        &self,
        kv: &[f32],
        tokens: usize,
        pages: &mut dyn PageWrite,
    ) -> Result<(), ModelError> {
        let g = self.geometry;
        let d = g.head_dim as usize;
        let tpp = g.tokens_per_page as usize;
        let size = g.dtype.size();
        for p in 0..pages.page_count() {
            let page = pages.page_mut(p).map_err(ModelError::Pool)?;
            page.fill(0);
            let first = p * tpp;
            let here = tokens.saturating_sub(first).min(tpp);
            for layer in 0..g.layers {
                for (k, which) in [Kv::K, Kv::V].into_iter().enumerate() {
                    for head in 0..g.kv_heads {
                        let run = ((layer as usize * 2 + k) * g.kv_heads as usize + head as usize)
                            * tokens
                            * d;
                        let src = &kv[run + first * d..run + (first + here) * d];
                        let dst = g.vector_offset(layer, which, head, 0);
                        for (i, v) in src.iter().enumerate() {
                            let o = dst + i * size;
                            g.dtype.encode(*v, &mut page[o..o + size]);
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

impl ModelRunner for EngineRunner {
    fn geometry(&self) -> &PageGeometry {
        &self.geometry
    }

    fn vocab(&self) -> u32 {
        self.vocab
    }

    fn prefill_chunked(
        &self,
        _prompt: &[u32],
        _pages: &mut dyn PageWrite,
        _keep_going: &mut dyn FnMut(usize) -> bool,
    ) -> Result<bool, ModelError> {
        Err(ModelError::Failed(
            "an engine runner prefills only for a reservation (prefill_owned)".into(),
        ))
    }

    fn prefill_owned(
        &self,
        owner: Owner,
        prompt: &[u32],
        pages: &mut dyn PageWrite,
        keep_going: &mut dyn FnMut(usize) -> bool,
    ) -> Result<bool, ModelError> {
        let deadline = Instant::now() + self.wait;
        let mut st = self.lock();
        st.waiting.insert(owner);
        st.jobs.push_back(Job {
            owner,
            prompt: prompt.to_vec(),
        });
        self.changed.notify_all();
        let outcome = loop {
            if let Some(outcome) = st.delivered.remove(&owner) {
                break Some(outcome);
            }
            if Instant::now() >= deadline {
                break None;
            }
            drop(st);
            let go_on = keep_going(0);
            st = self.lock();
            if !go_on {
                st.waiting.remove(&owner);
                st.jobs.retain(|j| j.owner != owner);
                st.delivered.remove(&owner);
                return Ok(false);
            }
            st = self
                .changed
                .wait_timeout(st, POLL)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        };
        st.waiting.remove(&owner);
        st.jobs.retain(|j| j.owner != owner);
        drop(st);
        match outcome {
            None => Err(ModelError::Failed(format!(
                "the engine delivered no KV within {} ms",
                self.wait.as_millis()
            ))),
            Some(Err(reason)) => Err(ModelError::Failed(format!(
                "the engine's prefill: {reason}"
            ))),
            Some(Ok((delivered, _))) if delivered != prompt => Err(ModelError::Failed(
                "the engine delivered KV of another prompt".into(),
            )),
            Some(Ok((_, kv))) => self.write_pages(&kv, prompt.len(), pages).map(|()| true),
        }
    }

    fn step(
        &self,
        _kv: &mut dyn KvCache,
        _input: u32,
        _step: u32,
        _prompt_len: u32,
    ) -> Result<u32, ModelError> {
        Err(ModelError::Failed(
            "an engine runner decodes only for a reservation (sample_batch)".into(),
        ))
    }

    fn sample_batch(&self, batch: &mut [BatchStep<'_>]) -> Vec<Result<u32, ModelError>> {
        batch
            .iter_mut()
            .map(|b| {
                let Some(owner) = b.owner else {
                    return Err(ModelError::Failed(
                        "no reservation to hand KV off from".into(),
                    ));
                };
                if b.step != 0 {
                    return Err(ModelError::Failed("the KV was handed off already".into()));
                }
                let kv = self.export(&*b.kv);
                let mut st = self.lock();
                self.expire(&mut st);
                if st.exports.len() >= MAX_EXPORTS
                    && let Some(oldest) =
                        st.exports.iter().min_by_key(|(_, e)| e.at).map(|(o, _)| *o)
                {
                    st.exports.remove(&oldest);
                }
                st.exports.insert(
                    owner,
                    Exported {
                        prompt_len: b.prompt_len,
                        last_token: b.input,
                        kv,
                        unix_us: std::time::SystemTime::now()
                            .duration_since(std::time::UNIX_EPOCH)
                            .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX)),
                        at: Instant::now(),
                    },
                );
                Ok(HANDED_OFF)
            })
            .collect()
    }

    fn model_id(&self) -> String {
        format!("{ENGINE_MODEL_PREFIX}{}", self.model_id)
    }

    fn is_stop(&self, token: u32) -> bool {
        token == HANDED_OFF
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::Dtype;
    use crate::model::{KvRead, MemoryKv};
    use crate::proto::Sampling;
    use crate::{Generation, RequestId};
    use std::sync::Arc;

    fn geometry() -> PageGeometry {
        PageGeometry {
            tokens_per_page: 4,
            layers: 2,
            kv_heads: 2,
            head_dim: 8,
            dtype: Dtype::F32,
        }
    }

    fn owner(n: u64) -> Owner {
        Owner {
            request: RequestId(n),
            generation: Generation(1),
        }
    }

    fn runner(wait_ms: u64) -> Arc<EngineRunner> {
        Arc::new(EngineRunner::new(
            geometry(),
            "engine:test".into(),
            100,
            Duration::from_millis(wait_ms),
            Duration::from_secs(60),
        ))
    }

    /// A value for every element, distinct per (layer, kv, head, pos, dim).
    fn kv_of(r: &EngineRunner, tokens: usize) -> Vec<f32> {
        (0..r.kv_len(tokens)).map(|i| i as f32 * 0.5).collect()
    }

    #[test]
    fn delivered_kv_lands_in_the_pages_and_comes_back_out_verbatim() {
        let r = runner(5_000);
        let prompt: Vec<u32> = (1..=10).collect();
        let mut mem = MemoryKv::new(geometry(), 10, 2);
        let engine = {
            let r = Arc::clone(&r);
            std::thread::spawn(move || {
                let job = r.next_job(Duration::from_secs(5)).expect("a job");
                assert_eq!(job.owner, owner(7));
                let kv = kv_of(&r, job.prompt.len());
                r.deliver(job.owner, job.prompt, kv).unwrap();
            })
        };
        let done = r
            .prefill_owned(owner(7), &prompt, &mut mem, &mut |_| true)
            .unwrap();
        engine.join().unwrap();
        assert!(done);
        mem.set_prefilled(10);
        // Every value in its place: read back through the page layout, position by position.
        let want = kv_of(&r, 10);
        let mut v = [0.0f32; 8];
        let mut at = 0;
        for layer in 0..2 {
            for which in [Kv::K, Kv::V] {
                for head in 0..2 {
                    for pos in 0..10u64 {
                        assert!(mem.read(layer, which, head, pos, &mut v));
                        assert_eq!(&v[..], &want[at..at + 8], "{layer} {which:?} {head} {pos}");
                        at += 8;
                    }
                }
            }
        }
        // Decode side: step 0 exports exactly that, taken once by its owner only.
        let mut steps = [BatchStep {
            owner: Some(owner(9)),
            kv: &mut mem,
            input: 10,
            step: 0,
            prompt_len: 10,
            sampling: &Sampling::GREEDY,
        }];
        assert_eq!(r.sample_batch(&mut steps), vec![Ok(HANDED_OFF)]);
        assert!(r.is_stop(HANDED_OFF));
        assert!(r.take_verified(owner(7)).is_none());
        let e = r.take_verified(owner(9)).expect("exported");
        assert_eq!((e.prompt_len, e.last_token), (10, 10));
        assert_eq!(e.kv, want);
        assert!(r.take_verified(owner(9)).is_none(), "taken once");
    }

    #[test]
    fn wrong_prompt_short_kv_failure_and_silence_fail_the_prefill() {
        let prompt: Vec<u32> = vec![3, 4, 5];
        // another prompt's KV
        let r = runner(5_000);
        let r2 = Arc::clone(&r);
        let t = std::thread::spawn(move || {
            let job = r2.next_job(Duration::from_secs(5)).unwrap();
            let kv = kv_of(&r2, 3);
            r2.deliver(job.owner, vec![3, 4, 6], kv).unwrap();
        });
        let mut mem = MemoryKv::new(geometry(), 3, 1);
        let err = r
            .prefill_owned(owner(1), &prompt, &mut mem, &mut |_| true)
            .unwrap_err();
        t.join().unwrap();
        assert!(err.to_string().contains("another prompt"), "{err}");
        // too few floats
        let r2 = Arc::clone(&r);
        let t = std::thread::spawn(move || {
            let job = r2.next_job(Duration::from_secs(5)).unwrap();
            let e = r2.deliver(job.owner, job.prompt, vec![0.0; 5]).unwrap_err();
            assert!(matches!(e, EngineError::BadLength { got: 5, .. }));
        });
        let err = r
            .prefill_owned(owner(2), &prompt, &mut mem, &mut |_| true)
            .unwrap_err();
        t.join().unwrap();
        assert!(err.to_string().contains("floats"), "{err}");
        // the engine says it failed
        let r2 = Arc::clone(&r);
        let t = std::thread::spawn(move || {
            let job = r2.next_job(Duration::from_secs(5)).unwrap();
            r2.fail(job.owner, "HTTP 500".into()).unwrap();
        });
        let err = r
            .prefill_owned(owner(3), &prompt, &mut mem, &mut |_| true)
            .unwrap_err();
        t.join().unwrap();
        assert!(err.to_string().contains("HTTP 500"), "{err}");
        // nobody answers
        let r = runner(50);
        let err = r
            .prefill_owned(owner(4), &prompt, &mut mem, &mut |_| true)
            .unwrap_err();
        assert!(err.to_string().contains("no KV within 50 ms"), "{err}");
        // a late delivery is refused, not kept
        let job = r.next_job(Duration::ZERO).is_none();
        assert!(job, "the job went with its prefill");
        assert_eq!(
            r.deliver(owner(4), prompt.clone(), kv_of(&r, 3)),
            Err(EngineError::NotWaiting(owner(4)))
        );
    }

    #[test]
    fn an_abandoned_prefill_stops_and_takes_its_job_back() {
        let r = runner(5_000);
        let mut mem = MemoryKv::new(geometry(), 3, 1);
        let mut asked = 0;
        let done = r
            .prefill_owned(owner(5), &[1, 2, 3], &mut mem, &mut |_| {
                asked += 1;
                asked < 3
            })
            .unwrap();
        assert!(!done);
        assert!(r.next_job(Duration::ZERO).is_none());
        assert!(r.deliver(owner(5), vec![1, 2, 3], kv_of(&r, 3)).is_err());
    }

    #[test]
    fn a_step_without_a_reservation_or_past_the_first_fails_alone() {
        let r = runner(50);
        let mut a = MemoryKv::new(geometry(), 2, 1);
        a.set_prefilled(2);
        let mut b = MemoryKv::new(geometry(), 2, 1);
        b.set_prefilled(2);
        let mut steps = [
            BatchStep {
                owner: None,
                kv: &mut a,
                input: 1,
                step: 0,
                prompt_len: 2,
                sampling: &Sampling::GREEDY,
            },
            BatchStep {
                owner: Some(owner(1)),
                kv: &mut b,
                input: 1,
                step: 1,
                prompt_len: 2,
                sampling: &Sampling::GREEDY,
            },
        ];
        let out = r.sample_batch(&mut steps);
        assert!(out.iter().all(|o| o.is_err()), "{out:?}");
        assert_eq!(r.exports(), 0);
    }
}
