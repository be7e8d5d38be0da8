//! kvprefault: how long pre-faulting a host pool takes, by method.
//!
//! `kvprefault [--gib N]... [--rounds R] [--threads T]...` creates a sealed memfd of each
//! size, maps and pre-faults it with each method, interleaved round by round, and prints the
//! median time per GiB: `MAP_POPULATE` (how pools were faulted before), `MADV_POPULATE_WRITE`
//! on one thread and on T threads, and the default of `map_rw` (huge pages asked for, one
//! thread per CPU up to 8). It says whether huge pages were used (`ShmemPmdMapped` of the
//! mapping). Prints figures, asserts nothing.

#![allow(clippy::print_stdout)]

use libkv::sys::memfd::{self, Prefault};
use std::time::Instant;

fn arg_values(args: &[String], name: &str) -> Vec<String> {
    args.windows(2)
        .filter(|w| w[0] == name)
        .map(|w| w[1].clone())
        .collect()
}

/// `ShmemPmdMapped` of this process (kB): huge pages of shmem mapped.
fn shmem_pmd_kib() -> u64 {
    std::fs::read_to_string("/proc/self/smaps_rollup")
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("ShmemPmdMapped:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let sizes: Vec<u64> = {
        let v: Vec<u64> = arg_values(&args, "--gib")
            .iter()
            .filter_map(|s| s.parse().ok())
            .collect();
        if v.is_empty() { vec![1, 3] } else { v }
    };
    let rounds: usize = arg_values(&args, "--rounds")
        .first()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    let cpus = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    let mut threads: Vec<usize> = arg_values(&args, "--threads")
        .iter()
        .filter_map(|s| s.parse().ok())
        .collect();
    if threads.is_empty() {
        threads = vec![2, cpus.min(8)];
        threads.dedup();
    }
    let shmem = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
        .unwrap_or_else(|_| "unknown".into());
    println!(
        "{cpus} CPUs; transparent_hugepage/shmem_enabled: {}",
        shmem.trim()
    );
    let mut methods: Vec<(String, Prefault)> = vec![
        ("MAP_POPULATE".into(), Prefault::MAP_POPULATE),
        (
            "MADV_POPULATE_WRITE, 1 thread".into(),
            Prefault {
                map_populate: false,
                threads: 1,
                huge_pages: false,
            },
        ),
    ];
    for &t in &threads {
        methods.push((
            format!("MADV_POPULATE_WRITE, {t} threads"),
            Prefault {
                map_populate: false,
                threads: t,
                huge_pages: false,
            },
        ));
    }
    methods.push((
        "default (huge pages asked, threads per CPU)".into(),
        Prefault::default(),
    ));
    for gib in sizes {
        let len = gib << 30;
        let mut times: Vec<Vec<f64>> = vec![Vec::new(); methods.len()];
        let mut huge = vec![0u64; methods.len()];
        for _ in 0..rounds {
            for (i, (_, how)) in methods.iter().enumerate() {
                let t = Instant::now();
                let fd = memfd::create_sealed(c"kvprefault", len).expect("memfd");
                let map =
                    memfd::map_rw_with(std::os::fd::AsFd::as_fd(&fd), len, *how).expect("map");
                times[i].push(t.elapsed().as_secs_f64());
                huge[i] = huge[i].max(shmem_pmd_kib());
                drop(map);
                drop(fd);
            }
        }
        println!("pool of {gib} GiB, median of {rounds} rounds:");
        for (i, (name, _)) in methods.iter().enumerate() {
            let v = &mut times[i];
            v.sort_by(f64::total_cmp);
            let med = v[v.len() / 2];
            println!(
                "  {name:<46} {med:>6.2} s  {:>5.2} s/GiB  huge pages mapped: {} MiB",
                med / gib as f64,
                huge[i] / 1024
            );
        }
    }
}
