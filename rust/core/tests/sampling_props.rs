//! Sampling behaviour through the public API: processing math, truncation, seeded determinism,
//! distribution and logprobs. Every random draw uses fixed seeds, so no test here can flake.

// The module name lets `cargo test -p stepllm-core sampling` select these tests.
mod sampling_props {
    use proptest::prelude::*;
    use stepllm_core::request::SamplingParams;
    use stepllm_core::sampling::{
        adjust_logits, sample_row, sample_rows, seeded_uniform, RowContext, Sampled,
    };

    fn row(params: &SamplingParams, seed: u64, position: u64) -> RowContext<'_> {
        RowContext {
            params,
            prompt_ids: &[],
            output_ids: &[],
            position,
            seed,
            banned: &[],
        }
    }

    fn sample(logits: &[f32], ctx: &RowContext) -> Sampled {
        sample_row(&mut logits.to_vec(), ctx)
    }

    fn random(temperature: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            ..SamplingParams::default()
        }
    }

    /// Reference argmax: first index of the maximum.
    fn argmax(x: &[f32]) -> u32 {
        let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        x.iter().position(|&l| l == max).unwrap() as u32
    }

    fn softmax(x: &[f32], temperature: f32) -> Vec<f64> {
        let scaled: Vec<f64> = x.iter().map(|&l| (l / temperature) as f64).collect();
        let max = scaled.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let exps: Vec<f64> = scaled.iter().map(|s| (s - max).exp()).collect();
        let total: f64 = exps.iter().sum();
        exps.iter().map(|e| e / total).collect()
    }

    /// Keeps only `keep` tokens of `probs` and renormalises.
    fn restrict(probs: &[f64], keep: &[usize]) -> Vec<f64> {
        let mass: f64 = keep.iter().map(|&i| probs[i]).sum();
        (0..probs.len())
            .map(|i| {
                if keep.contains(&i) {
                    probs[i] / mass
                } else {
                    0.0
                }
            })
            .collect()
    }

    /// Draw counts over positions 0..n of one seeded sequence, as a real request consumes them.
    fn histogram(logits: &[f32], params: &SamplingParams, n: u64) -> Vec<u64> {
        let mut counts = vec![0u64; logits.len()];
        for position in 0..n {
            counts[sample(logits, &row(params, 1234, position)).token_id as usize] += 1;
        }
        counts
    }

    /// Pearson's statistic against `expected`, below the p = 0.001 critical value for its degrees of
    /// freedom; tokens with zero expected probability must never be drawn.
    fn assert_matches(counts: &[u64], expected: &[f64]) {
        const CRITICAL_P001: [f64; 8] = [0.0, 10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32];
        let n: u64 = counts.iter().sum();
        let mut chi2 = 0.0;
        let mut support = 0;
        for (&observed, &p) in counts.iter().zip(expected) {
            if p == 0.0 {
                assert_eq!(
                    observed, 0,
                    "drew a token with zero probability: {counts:?}"
                );
                continue;
            }
            support += 1;
            let e = p * n as f64;
            chi2 += (observed as f64 - e).powi(2) / e;
        }
        let limit = CRITICAL_P001[support - 1];
        assert!(
            chi2 < limit,
            "chi2 {chi2:.2} >= {limit} for {counts:?} vs {expected:?}"
        );
    }

    const LOGITS: [f32; 6] = [1.0, 0.5, 0.0, -0.5, -1.0, 2.0];
    const DRAWS: u64 = 20_000;

    #[test]
    fn greedy_ties_go_to_the_lowest_id() {
        let params = SamplingParams::greedy(1);
        assert_eq!(
            sample(&[1.0, 3.0, 3.0, 0.0], &row(&params, 0, 0)).token_id,
            1
        );
    }

    #[test]
    fn logit_bias_forces_and_bans_tokens() {
        let logits = [3.0, 1.0, -2.0, 0.5, 2.5];
        let forced = SamplingParams {
            logit_bias: vec![(2, 100.0)],
            ..random(1.0)
        };
        for position in 0..200 {
            assert_eq!(sample(&logits, &row(&forced, 9, position)).token_id, 2);
        }
        let banned = SamplingParams {
            logit_bias: vec![(0, -100.0)],
            ..SamplingParams::greedy(1)
        };
        assert_eq!(sample(&logits, &row(&banned, 0, 0)).token_id, 4);
    }

    #[test]
    fn banned_ids_are_never_drawn_and_their_logprobs_stay_raw() {
        let logits = [3.0, 1.0, -2.0, 2.9, 2.5];
        let mut greedy = SamplingParams::greedy(1);
        greedy.logprobs = Some(2);
        let ctx = RowContext { banned: &[0, 3], ..row(&greedy, 0, 0) };
        let s = sample(&logits, &ctx);
        assert_eq!(s.token_id, 4);
        // Logprobs describe the model's raw distribution, as without the ban (vLLM's default).
        let raw = sample(&logits, &row(&greedy, 0, 0)).logprob.unwrap();
        assert_eq!(s.logprob.unwrap().top, raw.top);
        let random = random(1.5);
        for position in 0..300 {
            let t = sample(&logits, &RowContext { banned: &[0, 3, 4], ..row(&random, 7, position) }).token_id;
            assert!(t == 1 || t == 2, "drew banned token {t}");
        }
    }

    #[test]
    fn repetition_penalty_divides_positive_and_multiplies_negative_once_per_token() {
        let params = SamplingParams {
            repetition_penalty: 2.0,
            ..SamplingParams::greedy(1)
        };
        let ctx = RowContext {
            params: &params,
            prompt_ids: &[0, 0, 2],
            output_ids: &[0, 9999],
            position: 5,
            seed: 0,
            banned: &[],
        };
        let mut logits = vec![2.0, 1.5, -1.0, -1.2];
        adjust_logits(&mut logits, &ctx);
        assert_eq!(logits, vec![1.0, 1.5, -2.0, -1.2]);
        // The penalised favourite loses to the runner-up.
        assert_eq!(sample(&[2.0, 1.5, -1.0, -1.2], &ctx).token_id, 1);
        let negatives = [-1.0, -1.5, -3.0];
        let seen_first = RowContext {
            prompt_ids: &[],
            output_ids: &[0],
            ..ctx
        };
        assert_eq!(sample(&negatives, &seen_first).token_id, 1);
    }

    #[test]
    fn presence_and_frequency_penalties_count_output_tokens_only() {
        let params = SamplingParams {
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            ..SamplingParams::greedy(1)
        };
        let ctx = RowContext {
            params: &params,
            prompt_ids: &[1, 1, 4],
            output_ids: &[3, 3, 5, 3],
            position: 7,
            seed: 0,
            banned: &[],
        };
        let mut logits = vec![0.0f32; 6];
        adjust_logits(&mut logits, &ctx);
        // token 3: 3 * 0.25 + 0.5; token 5: 0.25 + 0.5; prompt-only tokens untouched.
        assert_eq!(logits, vec![0.0, 0.0, 0.0, -1.25, 0.0, -0.75]);
    }

    #[test]
    fn processing_applies_bias_then_repetition_then_presence() {
        let params = SamplingParams {
            logit_bias: vec![(0, 1.0)],
            repetition_penalty: 2.0,
            presence_penalty: 1.0,
            ..SamplingParams::greedy(1)
        };
        let ctx = RowContext {
            params: &params,
            prompt_ids: &[],
            output_ids: &[0],
            position: 1,
            seed: 0,
            banned: &[],
        };
        let mut logits = vec![3.0f32];
        adjust_logits(&mut logits, &ctx);
        // (3 + 1) / 2 - 1
        assert_eq!(logits, vec![1.0]);
    }

    #[test]
    fn min_p_filters_tokens_below_the_relative_floor() {
        let logits = [0.0, -1.0, -5.0, -10.0];
        let params = SamplingParams {
            min_p: 0.1,
            ..random(1.0)
        };
        let counts = histogram(&logits, &params, 4000);
        assert!(
            counts[0] > 0 && counts[1] > 0 && counts[2] == 0 && counts[3] == 0,
            "{counts:?}"
        );
    }

    #[test]
    fn seeded_draws_repeat_exactly() {
        let params = SamplingParams {
            top_p: 0.9,
            top_k: 4,
            ..random(0.7)
        };
        for position in 0..100 {
            let ctx = row(&params, 77, position);
            assert_eq!(sample(&LOGITS, &ctx), sample(&LOGITS, &ctx));
        }
        let differs = (0..100).any(|p| {
            sample(&LOGITS, &row(&params, 77, p)) != sample(&LOGITS, &row(&params, 78, p))
        });
        assert!(differs, "different seeds should give different sequences");
    }

    #[test]
    fn plain_temperature_draws_follow_softmax() {
        let params = random(0.8);
        assert_matches(&histogram(&LOGITS, &params, DRAWS), &softmax(&LOGITS, 0.8));
    }

    #[test]
    fn top_k_draws_follow_the_renormalised_top_k() {
        let params = SamplingParams {
            top_k: 3,
            ..random(1.3)
        };
        let expected = restrict(&softmax(&LOGITS, 1.3), &[5, 0, 1]);
        assert_matches(&histogram(&LOGITS, &params, DRAWS), &expected);
    }

    #[test]
    fn top_p_draws_follow_the_renormalised_nucleus() {
        let probs = softmax(&LOGITS, 1.0);
        // Sorted probabilities: 0.538, 0.198, 0.120, ...: the first three reach 0.8, the first two do not.
        assert!(probs[5] + probs[0] < 0.8 && probs[5] + probs[0] + probs[1] >= 0.8);
        let params = SamplingParams {
            top_p: 0.8,
            ..random(1.0)
        };
        assert_matches(
            &histogram(&LOGITS, &params, DRAWS),
            &restrict(&probs, &[5, 0, 1]),
        );
    }

    #[test]
    fn min_p_draws_follow_the_renormalised_survivors() {
        // Relative to e^2: e^1 (0.37), e^0.5 (0.22) and e^0 (0.135) pass 0.13; e^-0.5 (0.08) does not.
        let params = SamplingParams {
            min_p: 0.13,
            ..random(1.0)
        };
        let expected = restrict(&softmax(&LOGITS, 1.0), &[5, 0, 1, 2]);
        assert_matches(&histogram(&LOGITS, &params, DRAWS), &expected);
    }

    #[test]
    fn draws_over_many_seeds_at_one_position_follow_softmax() {
        let params = random(1.0);
        let mut counts = vec![0u64; LOGITS.len()];
        for seed in 0..DRAWS {
            counts[sample(&LOGITS, &row(&params, seed, 42)).token_id as usize] += 1;
        }
        assert_matches(&counts, &softmax(&LOGITS, 1.0));
    }

    #[test]
    fn top_p_nucleus_reaches_into_a_long_tail() {
        // One dominant token and 10k tail tokens whose mass the first candidate window does not see.
        let mut logits = vec![-12.0f32; 10_001];
        logits[0] = 0.0;
        let tail = (-12.0f64).exp();
        let needed = 0.99 * (1.0 + 10_000.0 * tail);
        let tail_kept = ((needed - 1.0) / tail).ceil() as u32;
        let params = SamplingParams {
            top_p: 0.99,
            ..random(1.0)
        };
        let mut drew_tail = false;
        for position in 0..2000 {
            let id = sample(&logits, &row(&params, 5, position)).token_id;
            assert!(
                id <= tail_kept,
                "token {id} lies outside the nucleus (last kept {tail_kept})"
            );
            drew_tail |= id > 0;
        }
        assert!(drew_tail);
    }

    #[test]
    fn logprobs_match_a_hand_computation_of_the_raw_logits() {
        let logits = [1.0f32, 2.0, 3.0, 0.0];
        let lse = (1f64.exp() + 2f64.exp() + 3f64.exp() + 1.0).ln() as f32;
        // The bias changes the choice but not the reported (raw) logprobs.
        let params = SamplingParams {
            logprobs: Some(2),
            logit_bias: vec![(0, 10.0)],
            ..SamplingParams::greedy(1)
        };
        let out = sample(&logits, &row(&params, 0, 3));
        assert_eq!(out.token_id, 0);
        let lp = out.logprob.unwrap();
        assert_eq!(lp.token_id, 0);
        assert!((lp.logprob - (1.0 - lse)).abs() < 1e-6);
        assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![2, 1]);
        assert!(
            (lp.top[0].1 - (3.0 - lse)).abs() < 1e-6 && (lp.top[1].1 - (2.0 - lse)).abs() < 1e-6
        );
        let without = SamplingParams {
            logprobs: None,
            ..params
        };
        assert_eq!(sample(&logits, &row(&without, 0, 3)).logprob, None);
    }

    #[test]
    fn seeded_uniform_depends_only_on_seed_and_position() {
        assert_eq!(seeded_uniform(3, 11), seeded_uniform(3, 11));
        assert!((0.0..1.0).contains(&seeded_uniform(u64::MAX, u64::MAX)));
    }

    fn logits_strategy(max_len: usize) -> impl Strategy<Value = Vec<f32>> {
        prop::collection::vec(-20.0f32..20.0, 1..max_len)
    }

    /// One row's own inputs for the batch-independence property.
    #[derive(Debug, Clone)]
    struct RowCase {
        logits: Vec<f32>,
        params: SamplingParams,
        output: Vec<u32>,
        seed: u64,
        position: u64,
    }

    const VOCAB: usize = 40;

    fn row_case() -> impl Strategy<Value = RowCase> {
        (
            prop::collection::vec(-10.0f32..10.0, VOCAB),
            (
                0.0f32..2.0,
                0usize..8,
                0.1f32..=1.0,
                0.0f32..0.5,
                0.8f32..1.5,
                any::<bool>(),
            ),
            prop::collection::vec(0u32..VOCAB as u32, 0..6),
            any::<u64>(),
            0u64..10_000,
        )
            .prop_map(
                |(
                    logits,
                    (temperature, top_k, top_p, min_p, repetition_penalty, lp),
                    output,
                    seed,
                    position,
                )| {
                    let params = SamplingParams {
                        temperature,
                        top_k,
                        top_p,
                        min_p,
                        repetition_penalty,
                        frequency_penalty: 0.3,
                        logprobs: lp.then_some(3),
                        ..SamplingParams::default()
                    };
                    RowCase {
                        logits,
                        params,
                        output,
                        seed,
                        position,
                    }
                },
            )
    }

    fn ctx_of(case: &RowCase) -> RowContext<'_> {
        RowContext {
            params: &case.params,
            prompt_ids: &[1, 2],
            output_ids: &case.output,
            position: case.position,
            seed: case.seed,
            banned: &[],
        }
    }

    fn batch(cases: &[&RowCase]) -> Vec<Sampled> {
        let mut logits: Vec<f32> = cases
            .iter()
            .flat_map(|c| c.logits.iter().copied())
            .collect();
        let ctxs: Vec<RowContext> = cases.iter().map(|c| ctx_of(c)).collect();
        sample_rows(&mut logits, VOCAB, &ctxs)
    }

    proptest! {
        #[test]
        fn greedy_is_argmax(logits in logits_strategy(400), seed in any::<u64>()) {
            let params = SamplingParams::greedy(1);
            prop_assert_eq!(sample(&logits, &row(&params, seed, 0)).token_id, argmax(&logits));
        }

        #[test]
        fn top_k_one_and_tiny_top_p_are_greedy(
            logits in logits_strategy(400), seed in any::<u64>(), position in any::<u64>(), t in 0.05f32..3.0,
        ) {
            let top_k_one = SamplingParams { top_k: 1, ..random(t) };
            prop_assert_eq!(sample(&logits, &row(&top_k_one, seed, position)).token_id, argmax(&logits));
            let tiny_top_p = SamplingParams { top_p: 1e-6, ..random(t) };
            prop_assert_eq!(sample(&logits, &row(&tiny_top_p, seed, position)).token_id, argmax(&logits));
        }

        #[test]
        fn draws_respect_top_k_top_p_and_min_p(
            logits in logits_strategy(300), seed in any::<u64>(), position in any::<u64>(),
            t in 0.1f32..3.0, top_k in 0usize..20, top_p in 0.05f32..=1.0, min_p in 0.0f32..0.9,
        ) {
            let params = SamplingParams { top_k, top_p, min_p, ..random(t) };
            let id = sample(&logits, &row(&params, seed, position)).token_id as usize;
            let scaled: Vec<f32> = logits.iter().map(|l| l / t).collect();
            let max = scaled.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let ranks_ahead = |i: usize, j: usize| scaled[i] > scaled[j] || (scaled[i] == scaled[j] && i < j);
            let ahead: Vec<usize> = (0..scaled.len()).filter(|&i| ranks_ahead(i, id)).collect();
            let k = if top_k == 0 { scaled.len() } else { top_k.min(scaled.len()) };
            prop_assert!(ahead.len() < k, "rank {} with top_k {}", ahead.len(), k);
            let weight = |i: usize| ((scaled[i] - max) as f64).exp();
            let mut ranked: Vec<usize> = (0..scaled.len()).collect();
            ranked.sort_by(|&a, &b| scaled[b].total_cmp(&scaled[a]).then(a.cmp(&b)));
            let top_k_mass: f64 = ranked[..k].iter().map(|&i| weight(i)).sum();
            let mass_ahead: f64 = ahead.iter().map(|&i| weight(i)).sum();
            prop_assert!(mass_ahead < top_p as f64 * top_k_mass * (1.0 + 1e-6), "outside the nucleus");
            if min_p > 0.0 {
                prop_assert!(scaled[id] >= max + min_p.ln(), "below the min-p floor");
            }
        }

        #[test]
        fn seeded_rows_ignore_order_and_neighbours(
            cases in prop::collection::vec(row_case(), 2..6), neighbours in prop::collection::vec(row_case(), 1..4),
        ) {
            let alone: Vec<Sampled> = cases.iter().map(|c| sample(&c.logits, &ctx_of(c))).collect();
            let in_order: Vec<&RowCase> = cases.iter().collect();
            prop_assert_eq!(&batch(&in_order), &alone);
            let reversed: Vec<&RowCase> = cases.iter().rev().collect();
            let mut back = batch(&reversed);
            back.reverse();
            prop_assert_eq!(&back, &alone);
            // Neighbours interleaved before every row.
            let mixed: Vec<&RowCase> = cases.iter().enumerate()
                .flat_map(|(i, c)| [&neighbours[i % neighbours.len()], c]).collect();
            let with_neighbours: Vec<Sampled> = batch(&mixed).into_iter().skip(1).step_by(2).collect();
            prop_assert_eq!(&with_neighbours, &alone);
        }

        #[test]
        fn logprobs_are_the_raw_log_softmax_sorted(
            logits in logits_strategy(300), n in 0usize..=20, t in 0.0f32..2.0, seed in any::<u64>(), bias in -5.0f32..5.0,
        ) {
            let params = SamplingParams { logprobs: Some(n), logit_bias: vec![(0, bias)], repetition_penalty: 1.3, ..random(t) };
            let ctx = RowContext { params: &params, prompt_ids: &[0, 1], output_ids: &[2], position: 9, seed, banned: &[] };
            let out = sample(&logits, &ctx);
            let lp = out.logprob.unwrap();
            let lse = logits.iter().map(|&l| (l as f64).exp()).sum::<f64>().ln();
            let expected = |id: u32| (logits[id as usize] as f64 - lse) as f32;
            prop_assert_eq!(lp.token_id, out.token_id);
            prop_assert!((lp.logprob - expected(out.token_id)).abs() < 1e-4);
            prop_assert_eq!(lp.top.len(), n.min(logits.len()));
            prop_assert!(lp.top.windows(2).all(|w| w[0].1 >= w[1].1), "not sorted: {:?}", lp.top);
            for &(id, value) in &lp.top {
                prop_assert!((value - expected(id)).abs() < 1e-4);
            }
            if n > 0 {
                prop_assert_eq!(lp.top[0].0, argmax(&logits));
            }
        }
    }
}
