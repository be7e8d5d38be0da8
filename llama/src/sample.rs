//! Picking the next token from logits: greedy, or a seeded draw at a temperature with a
//! top-p cut. A draw depends only on the logits, the sampling parameters and the step, so a
//! request with the same seed gives the same output wherever it is decoded.

use libkv::proto::Sampling;

/// The token `sampling` picks from `logits` at decode step `step`; `None` when every logit is
/// NaN. Greedy takes the most likely token (the lowest id on ties).
pub fn pick(logits: &[f32], sampling: &Sampling, step: u32) -> Option<usize> {
    let best = crate::math::argmax(logits)?;
    if sampling.is_greedy() {
        return Some(best);
    }
    let t = sampling.temperature();
    let top = logits[best];
    // Softmax at temperature t, over the finite logits, in f64 so the sum is exact enough.
    let mut probs: Vec<(usize, f64)> = logits
        .iter()
        .enumerate()
        .filter(|(_, l)| l.is_finite())
        .map(|(i, &l)| (i, (f64::from(l - top) / f64::from(t)).exp()))
        .filter(|&(_, p)| p > 0.0)
        .collect();
    // Most likely first; ties by id, so the order (and the draw) is deterministic.
    probs.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let total: f64 = probs.iter().map(|(_, p)| p).sum();
    let cut = f64::from(sampling.top_p()) * total;
    let mut kept = 0.0;
    let mut n = 0;
    for (_, p) in &probs {
        kept += p;
        n += 1;
        if kept >= cut {
            break;
        }
    }
    probs.truncate(n.max(1));
    let mass: f64 = probs.iter().map(|(_, p)| p).sum();
    let mut u = unit(sampling.seed, step) * mass;
    for &(i, p) in &probs {
        if u < p {
            return Some(i);
        }
        u -= p;
    }
    probs.last().map(|&(i, _)| i)
}

/// A uniform draw in [0, 1) from the seed and step (splitmix64 of both).
fn unit(seed: u64, step: u32) -> f64 {
    let mut z = seed ^ (u64::from(step).wrapping_add(1)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampled(temperature_milli: u32, top_p_milli: u32, seed: u64) -> Sampling {
        Sampling {
            temperature_milli,
            top_p_milli,
            seed,
        }
    }

    #[test]
    fn greedy_takes_the_argmax() {
        let l = [0.5, 3.0, 2.9, -1.0];
        for step in 0..10 {
            assert_eq!(pick(&l, &Sampling::GREEDY, step), Some(1));
        }
        assert_eq!(pick(&[f32::NAN], &Sampling::GREEDY, 0), None);
    }

    #[test]
    fn a_seed_gives_the_same_draws_and_seeds_differ() {
        let l: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let s = sampled(1000, 1000, 42);
        let a: Vec<_> = (0..64).map(|k| pick(&l, &s, k)).collect();
        let b: Vec<_> = (0..64).map(|k| pick(&l, &s, k)).collect();
        assert_eq!(a, b);
        let c: Vec<_> = (0..64)
            .map(|k| pick(&l, &sampled(1000, 1000, 43), k))
            .collect();
        assert_ne!(a, c, "another seed draws other tokens");
        let distinct: std::collections::HashSet<_> = a.iter().collect();
        assert!(
            distinct.len() > 5,
            "a flat distribution is not greedy: {distinct:?}"
        );
    }

    #[test]
    fn top_p_keeps_only_the_nucleus() {
        // One token holds almost all the mass: top_p 0.5 must always pick it.
        let l = [10.0, 0.0, 0.0, 0.0, 0.0];
        for step in 0..200 {
            assert_eq!(pick(&l, &sampled(1000, 500, 7), step), Some(0));
        }
        // Two equal tokens and a tail: top_p 0.6 keeps both, never the tail.
        let l = [5.0, 5.0, 0.0, 0.0];
        let seen: std::collections::HashSet<_> = (0..200)
            .map(|k| pick(&l, &sampled(1000, 600, 9), k).unwrap())
            .collect();
        assert_eq!(seen, [0, 1].into_iter().collect());
    }

    #[test]
    fn draws_follow_the_distribution() {
        // p = softmax([ln 3, 0]) = [0.75, 0.25] at temperature 1.
        let l = [3f32.ln(), 0.0];
        let n = 20_000;
        let zeros = (0..n)
            .filter(|&k| pick(&l, &sampled(1000, 1000, 1), k) == Some(0))
            .count();
        let share = zeros as f64 / f64::from(n);
        assert!((share - 0.75).abs() < 0.02, "{share}");
    }
}
