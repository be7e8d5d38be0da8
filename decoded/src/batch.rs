//! The decode stage: one batcher thread decodes every verified request together, one model
//! step over the whole active set at a time (continuous batching).
//!
//! The pull threads hand each request over once its pages are pulled and verified (a
//! [`Decoding`]). The batcher keeps them in two lists:
//!
//! - **waiting**: verified, in arrival order, for a slot of the active set;
//! - **active**: at most `max_batch` (`[decode] max_batch`) requests being decoded.
//!
//! Each iteration it takes what the pull threads verified (it blocks only while both lists
//! are empty), ends the requests that were cancelled or passed a deadline (waiting ones fail
//! saying they waited for a batch slot), moves the oldest waiting requests into the free
//! slots, and then calls [`ModelRunner::sample_batch`] once for every active request. Each
//! request then goes on by itself, exactly as [`libkv::model::decode_with`] would take it
//! alone: a stop token ends it (and is not emitted); otherwise the token is emitted (the
//! first one alone at once, then frames of up to [`TOKENS_PER_FRAME`] or whatever
//! [`FRAME_INTERVAL`] gathered), its cancel flag and its decode deadline are checked, and it
//! ends after `max_new_tokens`. A request that ends leaves its slot at once, so a request
//! waiting joins the running ones at the next step; a model error fails that request only.
//! A finished request sends `Done`; its pages are dropped before `Ended` tells the event loop
//! they are free.
//!
//! The model's `sample_batch` contract (each result is what `sample` gives for that request
//! alone) makes every output token for token the one decoding it alone gives: batching
//! changes when a token is computed, never which.

use crate::job::{JobContext, Stop, check, emitter, end, failed, micros};
use crossbeam::channel::{Receiver, TryRecvError};
use libkv::Owner;
use libkv::model::{BatchStep, ModelError, ModelRunner};
use libkv::proto::{Done, ErrorCode, Sampling, Tokens};
use libkv::verify::VerifiedKv;
use libkv::worker::add;
use std::collections::VecDeque;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Most tokens per `Tokens` frame.
pub(crate) const TOKENS_PER_FRAME: usize = 8;

/// Longest a generated token waits for the rest of its frame: a model slower than
/// `TOKENS_PER_FRAME` tokens in this time streams smaller frames, so a client sees each
/// token about when it exists. The first token always goes out alone, at once (time to
/// first token).
pub(crate) const FRAME_INTERVAL: Duration = Duration::from_millis(25);

/// A request whose pages were pulled and verified, waiting for a batch slot or decoding.
#[derive(Debug)]
pub(crate) struct Decoding {
    pub owner: Owner,
    pub epoch: u64,
    pub kv: VerifiedKv,
    /// Pages the job holds (its whole reservation), freed when it ends.
    pub held: u32,
    pub prompt_tokens: u32,
    /// Pages transferred.
    pub pages: u32,
    pub page_bytes: u64,
    pub max_new_tokens: u32,
    pub last_token: u32,
    pub sampling: Sampling,
    pub cancel: Arc<AtomicBool>,
    /// When the pages were reserved (for `Done::elapsed_us`).
    pub since: Instant,
    /// Longest decoding may take, from the first step.
    pub decode: Duration,
    pub request_deadline: Instant,
    /// When the pull thread handed it over.
    pub queued: Instant,
}

/// A request in the active set, between two steps.
#[derive(Debug)]
struct Active {
    d: Decoding,
    /// The next step's input: the prompt's last token, then the token the last step emitted.
    input: u32,
    /// The next step's index, which is also the count of tokens emitted so far.
    step: u32,
    /// The decode deadline, from the first step, capped by the request's.
    deadline: Instant,
    /// Tokens generated and not yet sent.
    frame: Vec<u32>,
    /// The index of `frame[0]` among the new tokens.
    first_index: u32,
    /// When the last frame went out.
    last_frame: Instant,
}

/// How a request goes on after a step.
enum Next {
    Continue,
    /// It ended: `Ok` finished (`max_new_tokens` or a stop token), or stopped.
    End(Result<(), Stop>),
}

/// The batcher thread's loop: until the pull threads are gone (`verified` closed) and every
/// request it had is over. See the module docs.
pub(crate) fn run(ctx: &JobContext, max_batch: usize, verified: &Receiver<Decoding>) {
    let max_batch = max_batch.max(1);
    let mut waiting: VecDeque<Decoding> = VecDeque::new();
    let mut active: Vec<Active> = Vec::with_capacity(max_batch);
    let mut open = true;
    loop {
        // Take what the pull threads verified; wait for it only when there is nothing to
        // decode.
        if active.is_empty() && waiting.is_empty() {
            if !open {
                return;
            }
            match verified.recv() {
                Ok(d) => waiting.push_back(d),
                Err(_) => return,
            }
        }
        while open {
            match verified.try_recv() {
                Ok(d) => waiting.push_back(d),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => open = false,
            }
        }
        // Cancelled, or past a deadline: they leave now, waiting or active.
        for d in std::mem::take(&mut waiting) {
            match check_waiting(&d, max_batch) {
                Ok(()) => waiting.push_back(d),
                Err(stop) => end_waiting(ctx, d, stop),
            }
        }
        for a in std::mem::take(&mut active) {
            match check(&a.d.cancel, a.d.owner, a.deadline, "decode") {
                Ok(()) => active.push(a),
                Err(stop) => finish(ctx, a, Err(stop)),
            }
        }
        // The oldest waiting requests take the free slots.
        while active.len() < max_batch
            && let Some(d) = waiting.pop_front()
        {
            if let Some(a) = join(ctx, d, max_batch) {
                active.push(a);
            }
        }
        if active.is_empty() {
            continue;
        }
        let results = step(ctx, &mut active);
        for (mut a, result) in std::mem::take(&mut active).into_iter().zip(results) {
            match after_step(ctx, &mut a, result) {
                Next::Continue => active.push(a),
                Next::End(result) => finish(ctx, a, result),
            }
        }
    }
}

/// Whether a waiting request may still wait: not cancelled, its request deadline ahead.
fn check_waiting(d: &Decoding, max_batch: usize) -> Result<(), Stop> {
    if d.cancel.load(Ordering::Acquire) {
        return Err(Stop::Cancelled);
    }
    if Instant::now() >= d.request_deadline {
        return Err(failed(
            ErrorCode::Timeout,
            format!(
                "{} waited {} ms for a decode batch slot (all {max_batch} were decoding other \
                 requests) and passed its request deadline",
                d.owner,
                d.queued.elapsed().as_millis()
            ),
        ));
    }
    Ok(())
}

/// A waiting request that leaves without a step.
fn end_waiting(ctx: &JobContext, d: Decoding, stop: Stop) {
    add(&ctx.counters.decode_wait_us, micros(d.queued.elapsed()));
    let (owner, epoch, held) = (d.owner, d.epoch, d.held);
    drop(d);
    end(ctx, owner, epoch, held, Err(stop));
}

/// Moves a waiting request into the active set: its decode deadline starts now. `None` if
/// it ended instead (cancelled or past its deadline just now, or nothing to generate).
fn join(ctx: &JobContext, d: Decoding, max_batch: usize) -> Option<Active> {
    if let Err(stop) = check_waiting(&d, max_batch) {
        end_waiting(ctx, d, stop);
        return None;
    }
    add(&ctx.counters.decode_wait_us, micros(d.queued.elapsed()));
    let now = Instant::now();
    let a = Active {
        input: d.last_token,
        step: 0,
        deadline: (now + d.decode).min(d.request_deadline),
        frame: Vec::with_capacity(TOKENS_PER_FRAME),
        first_index: 0,
        last_frame: now,
        d,
    };
    if a.d.max_new_tokens == 0 {
        finish(ctx, a, Ok(()));
        return None;
    }
    Some(a)
}

/// One decode step of every active request: one call of the model's `sample_batch`. A
/// panic in the model, or an answer of the wrong length, fails the requests it leaves
/// without a token.
fn step(ctx: &JobContext, active: &mut [Active]) -> Vec<Result<u32, ModelError>> {
    let model: &dyn ModelRunner = ctx.model.as_ref();
    let n = active.len();
    let mut batch: Vec<BatchStep<'_>> = active
        .iter_mut()
        .map(|a| BatchStep {
            owner: Some(a.d.owner),
            kv: &mut a.d.kv,
            input: a.input,
            step: a.step,
            prompt_len: a.d.prompt_tokens,
            sampling: &a.d.sampling,
        })
        .collect();
    let started = Instant::now();
    let ran = catch_unwind(AssertUnwindSafe(|| model.sample_batch(&mut batch)));
    let counters = &ctx.counters;
    add(&counters.decode_step_us, micros(started.elapsed()));
    add(&counters.decode_batch_steps, 1);
    add(&counters.decode_batch_requests, n as u64);
    let Ok(mut results) = ran else {
        log::error!("the model panicked in a decode step of {n} requests; failing them");
        return (0..n)
            .map(|_| {
                Err(ModelError::Failed(
                    "the model panicked in a decode step".into(),
                ))
            })
            .collect();
    };
    if results.len() != n {
        let got = results.len();
        results.truncate(n);
        results.resize_with(n, || {
            Err(ModelError::Failed(format!(
                "the model gave {got} results for a decode step of {n} requests"
            )))
        });
    }
    results
}

/// What one request does with its step's result: exactly the loop of
/// [`libkv::model::decode_with`] with the frame policy of a decode stream.
fn after_step(ctx: &JobContext, a: &mut Active, result: Result<u32, ModelError>) -> Next {
    let token = match result {
        Ok(t) => t,
        Err(e) => return Next::End(Err(Stop::from(e))),
    };
    if ctx.model.is_stop(token) {
        return Next::End(Ok(()));
    }
    add(&ctx.counters.tokens_generated, 1);
    a.frame.push(token);
    let step = a.step;
    if step == 0
        || a.frame.len() == TOKENS_PER_FRAME
        || step + 1 == a.d.max_new_tokens
        || a.last_frame.elapsed() >= FRAME_INTERVAL
    {
        send_frame(ctx, a);
        a.first_index = step + 1;
    }
    if let Err(stop) = check(&a.d.cancel, a.d.owner, a.deadline, "decode") {
        return Next::End(Err(stop));
    }
    a.step += 1;
    a.input = token;
    if a.step >= a.d.max_new_tokens {
        Next::End(Ok(()))
    } else {
        Next::Continue
    }
}

/// Sends the tokens of `a.frame` in one `Tokens` frame.
fn send_frame(ctx: &JobContext, a: &mut Active) {
    a.last_frame = Instant::now();
    let tokens = std::mem::replace(&mut a.frame, Vec::with_capacity(TOKENS_PER_FRAME));
    emitter(ctx, a.d.owner, a.d.epoch)(
        Tokens {
            first_index: a.first_index,
            tokens,
        }
        .into(),
    );
}

/// The end of an active request. Finished: the last (short) frame, if any, and `Done` with
/// the signature over every position it holds; stopped: nothing more (its error, if any,
/// comes from [`end`]). Its pages are dropped before `Ended`.
fn finish(ctx: &JobContext, mut a: Active, result: Result<(), Stop>) {
    if result.is_ok() {
        if !a.frame.is_empty() {
            // The model stopped (end of turn) before max_new_tokens: the last frame is short.
            send_frame(ctx, &mut a);
        }
        let d = &a.d;
        emitter(ctx, d.owner, d.epoch)(
            Done {
                tokens: a.step,
                signature: ctx.model.signature(&d.kv),
                pages_transferred: d.pages,
                bytes_transferred: u64::from(d.pages) * d.page_bytes,
                elapsed_us: micros(d.since.elapsed()),
                // kvctld fills in who served the request.
                prefill_worker: String::new(),
                decode_worker: String::new(),
            }
            .into(),
        );
    }
    let (owner, epoch, held) = (a.d.owner, a.d.epoch, a.d.held);
    drop(a);
    end(ctx, owner, epoch, held, result);
}

#[cfg(test)]
mod tests {
    use crate::job::testing::{Harness, Probe, Told};
    use libkv::proto::ErrorCode;
    use std::collections::HashMap;
    use std::sync::atomic::Ordering;
    use std::time::Duration;

    /// A prompt's length, by which the model's record tells the requests apart.
    fn len<T>(p: &[T]) -> u32 {
        u32::try_from(p.len()).unwrap()
    }

    /// The steps of the request of `prompt_len` in the model's record: (call, step).
    fn steps_of(calls: &[Vec<(u32, u32)>], prompt_len: u32) -> Vec<(usize, u32)> {
        calls
            .iter()
            .enumerate()
            .flat_map(|(i, c)| {
                c.iter()
                    .filter(move |(len, _)| *len == prompt_len)
                    .map(move |(_, step)| (i, *step))
            })
            .collect()
    }

    /// Fails unless the request of `prompt_len` was stepped once per call from its first
    /// step to its last, steps 0, 1, 2, ... in consecutive calls: never skipped, never
    /// repeated, however others came and went. Returns its first and last call.
    fn stepped_in_order(calls: &[Vec<(u32, u32)>], prompt_len: u32, steps: u32) -> (usize, usize) {
        let seen = steps_of(calls, prompt_len);
        assert_eq!(
            seen.len(),
            steps as usize,
            "steps of {prompt_len}: {seen:?}"
        );
        let first = seen[0].0;
        for (k, (call, step)) in seen.iter().enumerate() {
            assert_eq!(
                (*call, *step as usize),
                (first + k, k),
                "{prompt_len}: {seen:?}"
            );
        }
        (first, first + seen.len() - 1)
    }

    fn has_tokens(t: &HashMap<u64, Told>, r: u64) -> bool {
        t.get(&r).is_some_and(|t| !t.tokens.is_empty())
    }

    #[test]
    fn a_request_that_arrives_mid_way_is_stepped_together_with_the_running_one() {
        let mut h = Harness::new(Probe::new(Duration::from_millis(5)), 4);
        let (a, b) = (
            &b"a long request, already decoding"[..],
            &b"a short one"[..],
        );
        h.submit(1, a, 120);
        h.wait_for(|t| t.get(&1).is_some_and(|t| t.tokens.len() >= 10));
        h.submit(2, b, 12);
        let told = h.wait_all_ended();
        h.assert_alone_output(&told, 1);
        h.assert_alone_output(&told, 2);
        let calls = h.model.calls();
        let (a_len, b_len) = (len(a), len(b));
        let (a_first, a_last) = stepped_in_order(&calls, a_len, 120);
        let (b_first, b_last) = stepped_in_order(&calls, b_len, 12);
        // b joined a running request (a past its 10th step) and shared its steps; it left
        // first and a went on alone, still one step per call.
        assert!(a_first < b_first && b_last < a_last, "{calls:?}");
        assert!(
            calls[b_first].iter().any(|&(l, s)| l == a_len && s >= 10),
            "{calls:?}"
        );
        for c in &calls[b_first..=b_last] {
            assert_eq!(c.len(), 2, "{calls:?}");
        }
        assert!(
            calls[b_last + 1..].iter().all(|c| c.len() == 1),
            "{calls:?}"
        );
        // The frames of b ended before a's Done.
        let at = |want: &dyn Fn(&crate::job::testing::Seen) -> bool| {
            h.seen.iter().position(want).expect("seen")
        };
        use crate::job::testing::Seen;
        use libkv::proto::Message;
        let b_done = at(&|s| matches!(s, Seen::Frame(2, Message::Done(_))));
        let a_done = at(&|s| matches!(s, Seen::Frame(1, Message::Done(_))));
        assert!(b_done < a_done);
    }

    #[test]
    fn a_request_ending_at_max_new_or_a_stop_token_leaves_the_others_undisturbed() {
        let mut probe = Probe::new(Duration::from_millis(3));
        probe.stop = Some(u32::from(b'!'));
        let mut h = Harness::new(probe, 8);
        let long = &b"the long one runs on and on past both"[..];
        // The reference model echoes the prompt: this one stops at its '!' (9 tokens).
        let stops = &b"stop here! not this"[..];
        let short = &b"four"[..];
        h.submit(1, long, 90);
        h.submit(2, stops, 40);
        h.submit(3, short, 5);
        let told = h.wait_all_ended();
        for r in 1..=3 {
            h.assert_alone_output(&told, r);
        }
        assert_eq!(told[&2].tokens, libkv::model::tokenize(b"stop here"));
        let calls = h.model.calls();
        let (_, long_last) = stepped_in_order(&calls, len(long), 90);
        // The stop token's step is the request's last (its token is not emitted).
        let (_, stops_last) = stepped_in_order(&calls, len(stops), 10);
        let (_, short_last) = stepped_in_order(&calls, len(short), 5);
        assert!(
            short_last < long_last && stops_last < long_last,
            "{calls:?}"
        );
        assert!(
            calls.iter().any(|c| c.len() == 3),
            "never stepped together: {calls:?}"
        );
    }

    #[test]
    fn a_cancelled_request_leaves_at_its_next_step_and_the_others_go_on() {
        let mut h = Harness::new(Probe::new(Duration::from_millis(5)), 4);
        let (a, b) = (
            &b"the one that finishes"[..],
            &b"the one that is cancelled"[..],
        );
        h.submit(1, a, 100);
        h.submit(2, b, 100);
        h.wait_for(|t| has_tokens(t, 1) && has_tokens(t, 2));
        let before = h.model.calls().len();
        h.cancels[&2].store(true, Ordering::Release);
        h.wait_for(|t| t.get(&2).is_some_and(|t| t.ended));
        let told = h.told();
        assert!(told[&1].done.is_none(), "the other one is still decoding");
        assert!(
            told[&2].done.is_none() && told[&2].error.is_none(),
            "a cancelled request says nothing: {:?}",
            told[&2]
        );
        let told = h.wait_all_ended();
        h.assert_alone_output(&told, 1);
        let calls = h.model.calls();
        // At most the step already under way when the flag was set (or just about to be).
        let after = steps_of(&calls, len(b))
            .iter()
            .filter(|(i, _)| *i >= before)
            .count();
        assert!(after <= 1, "{after} steps after the cancel: {calls:?}");
        stepped_in_order(&calls, len(a), 100);
    }

    #[test]
    fn no_more_than_max_batch_are_stepped_at_once_and_the_rest_wait_their_turn() {
        let mut h = Harness::new(Probe::new(Duration::from_millis(2)), 2);
        let prompts: Vec<Vec<u8>> = (0..6)
            .map(|i| format!("request {i}{}", ".".repeat(i)).into_bytes())
            .collect();
        for (i, p) in prompts.iter().enumerate() {
            h.submit(i as u64 + 1, p, 10 + 7 * len(&prompts[..i]));
        }
        let told = h.wait_all_ended();
        let calls = h.model.calls();
        assert!(calls.iter().all(|c| c.len() <= 2), "{calls:?}");
        assert!(calls.iter().any(|c| c.len() == 2), "{calls:?}");
        for (i, p) in prompts.iter().enumerate() {
            h.assert_alone_output(&told, i as u64 + 1);
            stepped_in_order(&calls, len(p), 10 + 7 * len(&prompts[..i]));
        }
    }

    #[test]
    fn a_model_error_fails_only_its_request() {
        let mut probe = Probe::new(Duration::from_millis(2));
        let bad = &b"the request the model fails"[..];
        probe.fail = Some((len(bad), 3));
        let mut h = Harness::new(probe, 4);
        h.submit(1, b"a good request", 20);
        h.submit(2, bad, 20);
        h.submit(3, b"another good one", 20);
        let told = h.wait_all_ended();
        h.assert_alone_output(&told, 1);
        h.assert_alone_output(&told, 3);
        let e = told[&2].error.as_ref().expect("an error");
        assert_eq!(e.code, ErrorCode::Internal);
        assert!(e.message.contains("injected at step 3"), "{e:?}");
        assert!(told[&2].done.is_none());
    }

    #[test]
    fn a_panic_in_the_model_fails_its_batch_and_the_batcher_serves_on() {
        let mut probe = Probe::new(Duration::from_millis(2));
        let bad = &b"the request the model panics on"[..];
        probe.panic = Some((len(bad), 2));
        let mut h = Harness::new(probe, 4);
        h.submit(1, b"decoded beside it", 400);
        h.wait_for(|t| has_tokens(t, 1));
        h.submit(2, bad, 20);
        h.wait_for(|t| [1, 2].iter().all(|r| t.get(r).is_some_and(|t| t.ended)));
        let told = h.told();
        for r in [1, 2] {
            let e = told[&r].error.as_ref().expect("an error");
            assert_eq!(e.code, ErrorCode::Internal);
            assert!(e.message.contains("the model panicked"), "{e:?}");
        }
        h.submit(3, b"after the panic", 10);
        let told = h.wait_all_ended();
        h.assert_alone_output(&told, 3);
    }

    #[test]
    fn a_request_that_waits_for_a_slot_past_its_deadline_fails_saying_so_at_once() {
        let mut h = Harness::new(Probe::new(Duration::from_millis(10)), 1);
        h.submit(1, b"holds the only slot", 200);
        h.wait_for(|t| has_tokens(t, 1));
        h.submit_until(2, b"waits for it", 8, Duration::from_millis(300));
        h.wait_for(|t| t.get(&2).is_some_and(|t| t.ended));
        let told = h.told();
        assert!(
            told[&1].done.is_none(),
            "it failed only once the slot was free"
        );
        let e = told[&2].error.as_ref().expect("an error");
        assert_eq!(e.code, ErrorCode::Timeout);
        assert!(
            e.message
                .contains("for a decode batch slot (all 1 were decoding other requests)"),
            "{e:?}"
        );
        assert!(told[&2].pulled && told[&2].tokens.is_empty());
        let told = h.wait_all_ended();
        h.assert_alone_output(&told, 1);
    }
}
