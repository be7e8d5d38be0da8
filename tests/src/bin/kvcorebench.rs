//! kvcorebench: admission decisions per second of kvctld's sans-IO core with many workers,
//! on one core. A benchmark, not a test: it prints figures and asserts only that the run
//! did what it says (every request admitted, every pool whole at the end).
//!
//! Each round submits `--batch` requests to a core holding `--prefill` + `--decode`
//! workers (timed: one decision is `Submit` -> static checks -> a pair picked by the
//! pairing policy -> both ledgers charged -> `DecodeReserve` queued), then drives every
//! request through its whole life as the workers would answer (`DecodeReserved`,
//! `PrefillDone`, `PullDone`, `Done`, both `Freed`; timed separately), so each round starts
//! with every pool whole again.

#![allow(clippy::print_stdout)]

use clap::Parser;
use kvctld::ctl::core::{Action, Core, CoreConfig};
use libkv::admission::Limits;
use libkv::config::{DeadlineDurations, Pairing};
use libkv::proto::{
    DecodeReserved, Done, Freed, Message, PrefillDone, PullDone, RegisterWorker, Role, Submit,
    Transport,
};
use libkv::verify::Manifest;
use libkv::{Dtype, Generation, Owner, PageGeometry, PageId};
use std::collections::HashMap;
use std::process::ExitCode;
use std::time::{Duration, Instant};

#[derive(Parser, Debug)]
#[command(
    name = "kvcorebench",
    about = "admission decisions per second of kvctld's core"
)]
struct Args {
    /// Prefill workers.
    #[arg(long, default_value_t = 64)]
    prefill: usize,
    /// Decode workers.
    #[arg(long, default_value_t = 64)]
    decode: usize,
    /// Requests admitted per round (all in flight together).
    #[arg(long, default_value_t = 4096)]
    batch: usize,
    /// Rounds.
    #[arg(long, default_value_t = 100)]
    rounds: usize,
    /// Pairing policy: most-free, fewest-in-flight or power-of-two.
    #[arg(long, default_value = "most-free")]
    pairing: String,
}

const TPP: u32 = 16;

fn geometry() -> PageGeometry {
    PageGeometry {
        tokens_per_page: TPP,
        layers: 2,
        kv_heads: 2,
        head_dim: 16,
        dtype: Dtype::Bf16,
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    let pairing = match args.pairing.as_str() {
        "most-free" => Pairing::MostFree,
        "fewest-in-flight" => Pairing::FewestInFlight,
        "power-of-two" => Pairing::PowerOfTwo,
        other => {
            eprintln!("kvcorebench: unknown pairing {other:?}");
            return ExitCode::from(1);
        }
    };
    // Pools that hold a whole batch: requests of 2 prefill and 2 decode pages.
    let pool_pages = 1 << 16;
    let cfg = CoreConfig {
        geometry: geometry(),
        limits: Limits {
            geometry: geometry(),
            max_context: 4096,
            max_new_tokens: 256,
            prefill_pages: pool_pages,
            decode_pages: pool_pages,
        },
        deadlines: DeadlineDurations {
            admission_wait: Duration::from_secs(60),
            bootstrap: Duration::from_secs(60),
            prefill: Duration::from_secs(60),
            transfer: Duration::from_secs(60),
            decode: Duration::from_secs(60),
            request: Duration::from_secs(600),
            drain: Duration::from_secs(60),
        },
        admission_queue: 1 << 20,
        pairing,
        seed: 1,
        placeholder_fault: false,
        model_kind: libkv::config::ModelKind::Reference,
    };
    let generation = Generation(1);
    let mut core = Core::new(cfg, generation);
    let now = Instant::now();
    let client = 1usize;
    let mut conn_role: HashMap<usize, Role> = HashMap::new();
    for i in 0..args.prefill + args.decode {
        let conn = 100 + i;
        let role = if i < args.prefill {
            Role::Prefill
        } else {
            Role::Decode
        };
        conn_role.insert(conn, role);
        let r = RegisterWorker {
            id: format!("{}-{i}", if role == Role::Prefill { "p" } else { "d" }),
            role,
            geometry: geometry(),
            pool_pages,
            transports: vec![Transport::Shm, Transport::Tcp],
            endpoint: None,
            model: "reference".into(),
            max_batch: if role == Role::Decode {
                libkv::proto::MAX_BATCH
            } else {
                0
            },
        };
        if core.register(conn, r, true, now).is_err() {
            eprintln!("kvcorebench: registration refused");
            return ExitCode::from(2);
        }
    }
    core.take_actions();
    let prompt = vec![b'a'; 24]; // 2 prefill pages, 2 + 2 decode pages with 8 new tokens
    let (mut decide, mut lifecycle) = (Duration::ZERO, Duration::ZERO);
    let mut decisions = 0u64;
    let mut actions: Vec<Action> = Vec::new();
    let progress = libkv::progress::bar(args.rounds as u64, "rounds");
    for _ in 0..args.rounds {
        progress.inc(1);
        // The frames as the event loop hands them over, decoded: built outside the timing.
        let submits: Vec<Submit> = (0..args.batch)
            .map(|_| Submit {
                tenant: "bench".into(),
                prompt: libkv::model::tokenize(&prompt),
                max_new_tokens: 8,
                deadline_ms: 0,
                sampling: libkv::proto::Sampling::GREEDY,
            })
            .collect();
        let t = Instant::now();
        for s in submits {
            core.submit(client, s, now);
        }
        actions.extend(core.take_actions());
        decide += t.elapsed();
        decisions += args.batch as u64;
        let t = Instant::now();
        if let Err(e) = complete(&mut core, &mut actions, &conn_role, generation, now) {
            eprintln!("kvcorebench: {e}");
            return ExitCode::from(2);
        }
        lifecycle += t.elapsed();
    }
    progress.finish_and_clear();
    if core.in_flight() != 0 || core.check_ledgers().is_err() {
        eprintln!("kvcorebench: requests or pages left at the end");
        return ExitCode::from(2);
    }
    let admitted = core.counters().admitted;
    if admitted != decisions {
        eprintln!("kvcorebench: {admitted} of {decisions} admitted");
        return ExitCode::from(2);
    }
    let rate = |n: u64, d: Duration| n as f64 / d.as_secs_f64();
    println!(
        "kvcorebench: {} + {} workers, pairing {}, {} rounds of {} requests in flight",
        args.prefill, args.decode, args.pairing, args.rounds, args.batch
    );
    println!(
        "admission decisions: {:.0}/s ({:.0} ns each)",
        rate(decisions, decide),
        decide.as_nanos() as f64 / decisions as f64
    );
    println!(
        "whole request lifecycles in the core (7 events each): {:.0}/s",
        rate(decisions, lifecycle)
    );
    // What `/metrics` costs the event loop: every REFRESH it builds the status and copies the
    // latency histograms for the HTTP thread (rendering happens there, at a scrape).
    let snapshot = kvctld::metrics::Snapshot::default();
    let publishes = 2000u32;
    let t = Instant::now();
    for _ in 0..publishes {
        snapshot.publish(core.status(&[]), core.latencies().clone());
    }
    let each = t.elapsed() / publishes;
    let per_s = 1.0 / kvctld::metrics::REFRESH.as_secs_f64();
    println!(
        "metrics publish (status + histograms, every {} ms): {:.1} us each, {:.4}% of one core; \
         the time of {:.0} admission decisions per second",
        kvctld::metrics::REFRESH.as_millis(),
        each.as_secs_f64() * 1e6,
        each.as_secs_f64() * per_s * 100.0,
        each.as_secs_f64() * per_s * rate(decisions, decide),
    );
    ExitCode::SUCCESS
}

/// Answers every frame as the workers would until no request is left.
fn complete(
    core: &mut Core,
    actions: &mut Vec<Action>,
    roles: &HashMap<usize, Role>,
    generation: Generation,
    now: Instant,
) -> Result<(), String> {
    while !actions.is_empty() {
        for action in std::mem::take(actions) {
            let Action::Send { conn, id, msg } = action else {
                continue;
            };
            if !roles.contains_key(&conn) {
                continue;
            }
            let owner = Owner {
                request: id,
                generation,
            };
            match msg {
                Message::DecodeReserve(m) => {
                    let pages = (m.prompt_tokens + m.max_new_tokens).div_ceil(TPP);
                    core.worker_frame(conn, id, DecodeReserved { owner, pages }.into(), now);
                }
                Message::PrefillRun(m) => {
                    let tokens = u32::try_from(m.prompt.len()).map_err(|e| e.to_string())?;
                    let n = tokens.div_ceil(TPP);
                    let manifest = Manifest {
                        owner,
                        tokens,
                        pages: (0..n).map(PageId).collect(),
                        digests: vec![0; n as usize],
                    };
                    core.worker_frame(conn, id, PrefillDone { manifest }.into(), now);
                }
                Message::PullKv(m) => {
                    core.worker_frame(conn, id, PullDone { owner }.into(), now);
                    let done = Done {
                        tokens: m.max_new_tokens,
                        signature: 0,
                        pages_transferred: 0,
                        bytes_transferred: 0,
                        elapsed_us: 0,
                        prefill_worker: String::new(),
                        decode_worker: String::new(),
                    };
                    core.worker_frame(conn, id, done.into(), now);
                    let pages = (m.manifest.tokens + m.max_new_tokens).div_ceil(TPP);
                    core.worker_frame(conn, id, Freed { owner, pages }.into(), now);
                }
                Message::Release(_) => {
                    core.worker_frame(conn, id, Freed { owner, pages: 0 }.into(), now);
                }
                Message::Error(e) => return Err(format!("{id}: {}", e.message)),
                _ => {}
            }
            actions.extend(core.take_actions());
        }
    }
    Ok(())
}
