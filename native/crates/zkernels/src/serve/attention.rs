//! Decode attention over the paged KV cache: each sequence's one query token
//! attends to its keys `0 .. len` read through its block table, with no
//! gathered copy of the keys and no mask. Grouped-query attention: the
//! `H / KV` query heads of a KV head are one task, so each key and value is
//! read once per KV head. Scores, softmax and the weighted sum are f32; the
//! result is rounded to the element type once. Tested against
//! `zserve.model.attention.paged_attention_reference`; the CUDA twin is
//! `znative/cuda/kernels/paged_attention.cu`.

use super::{check_len, dot, for_tasks, param, Shared};
use crate::bf16::Elem;
use crate::quant::QuantError;
use crate::simd::multiversion;

/// Shapes of [`paged_decode_attention`].
#[derive(Clone, Copy, Debug)]
pub struct AttnDims {
    /// Sequences S (one query token each).
    pub num_seqs: usize,
    /// Query heads H (a multiple of `num_kv_heads`).
    pub num_heads: usize,
    /// Key/value heads KV.
    pub num_kv_heads: usize,
    /// Elements per head D.
    pub head_dim: usize,
    /// Blocks in each cache.
    pub num_blocks: usize,
    /// Positions per block.
    pub block_size: usize,
    /// Columns of `block_tables`.
    pub max_blocks: usize,
}

/// `out (S, H, D)` = softmax(`scale` q k^T) v for `q (S, H, D)` over the caches
/// `(num_blocks, block_size, KV, D)`: sequence `s` reads its key `j` at block
/// `block_tables[s, j / block_size]`, offset `j % block_size`, for
/// `j < context_lens[s]`.
#[allow(clippy::too_many_arguments)]
pub fn paged_decode_attention<E: Elem>(
    q: &[E],
    k_cache: &[E],
    v_cache: &[E],
    block_tables: &[i64],
    context_lens: &[i32],
    scale: f32,
    d: AttnDims,
    out: &mut [E],
) -> Result<(), QuantError> {
    let (s_n, h, kv, hd, bs) = (
        d.num_seqs,
        d.num_heads,
        d.num_kv_heads,
        d.head_dim,
        d.block_size,
    );
    if kv == 0 || !h.is_multiple_of(kv) {
        return Err(param("num_kv_heads", kv as i64, "a divisor of num_heads"));
    }
    if hd == 0 || bs == 0 {
        return Err(param(
            "head_dim/block_size",
            0,
            "head_dim >= 1 and block_size >= 1",
        ));
    }
    check_len("q", q.len(), s_n * h * hd, || {
        format!("seqs * heads * head_dim for {d:?}")
    })?;
    check_len("out", out.len(), q.len(), || "q's length".into())?;
    let cache = d.num_blocks * bs * kv * hd;
    for (what, c) in [("k_cache", k_cache.len()), ("v_cache", v_cache.len())] {
        check_len(what, c, cache, || {
            "num_blocks * block_size * kv_heads * head_dim".into()
        })?;
    }
    check_len(
        "block_tables",
        block_tables.len(),
        s_n * d.max_blocks,
        || "seqs * max_blocks".into(),
    )?;
    check_len("context_lens", context_lens.len(), s_n, || "seqs".into())?;
    for (s, &len) in context_lens.iter().enumerate() {
        if len < 1 || len as usize > d.max_blocks * bs {
            return Err(param(
                "context_len",
                len.into(),
                "in [1, max_blocks * block_size]",
            ));
        }
        let used = (len as usize).div_ceil(bs);
        let table = &block_tables[s * d.max_blocks..s * d.max_blocks + used];
        if let Some(&b) = table.iter().find(|&&b| b < 0 || b as usize >= d.num_blocks) {
            return Err(param("block id", b, "in [0, num_blocks)"));
        }
    }
    let group = h / kv;
    let longest = context_lens.iter().map(|&l| l as usize).max().unwrap_or(0);
    let dst = Shared(out.as_mut_ptr());
    for_tasks(s_n * kv, s_n * h * longest * hd * 2, |task| {
        let (s, g) = (task / kv, task % kv);
        let heads = (s * h + g * group) * hd..(s * h + (g + 1) * group) * hd;
        // SAFETY: task (s, g) owns the rows of its `group` query heads of sequence s.
        let o = unsafe { dst.range(heads.start, heads.len()) };
        let table = &block_tables[s * d.max_blocks..(s + 1) * d.max_blocks];
        let len = context_lens[s] as usize;
        let mut scores = vec![0f32; group * len];
        let mut acc = vec![0f32; group * hd];
        let p = Task {
            table,
            len,
            g,
            kv,
            hd,
            bs,
            scale,
        };
        #[cfg(target_arch = "x86_64")]
        if crate::simd::active() >= crate::simd::SimdLevel::Avx2 && hd.is_multiple_of(8) {
            // SAFETY: `active()` reports AVX2 or above only when the CPU has AVX2 and FMA;
            // the block table and buffer sizes were checked above.
            unsafe {
                super::attention_avx2::attend(
                    &q[heads],
                    k_cache,
                    v_cache,
                    &p,
                    &mut scores,
                    &mut acc,
                    o,
                )
            };
            return;
        }
        attend_auto(&q[heads], k_cache, v_cache, &p, &mut scores, &mut acc, o);
    });
    Ok(())
}

/// One (sequence, KV head) task's inputs besides the buffers.
pub(super) struct Task<'a> {
    /// The sequence's block table.
    pub(super) table: &'a [i64],
    /// Keys attended to.
    pub(super) len: usize,
    /// The KV head.
    pub(super) g: usize,
    pub(super) kv: usize,
    pub(super) hd: usize,
    pub(super) bs: usize,
    pub(super) scale: f32,
}

#[inline(always)]
fn attend_body<E: Elem>(
    q: &[E],
    kc: &[E],
    vc: &[E],
    p: &Task<'_>,
    scores: &mut [f32],
    acc: &mut [f32],
    out: &mut [E],
) {
    let (hd, len) = (p.hd, p.len);
    let group = q.len() / hd;
    let qf: Vec<f32> = q.iter().map(|v| v.to_f32()).collect();
    let base = |j: usize| ((p.table[j / p.bs] as usize * p.bs + j % p.bs) * p.kv + p.g) * hd;
    for j in 0..len {
        let k = &kc[base(j)..base(j) + hd];
        for i in 0..group {
            scores[i * len + j] = dot(&qf[i * hd..(i + 1) * hd], k) * p.scale;
        }
    }
    let mut sums = [0f32; 64];
    let mut sums_big = Vec::new();
    let sums: &mut [f32] = if group <= 64 {
        &mut sums[..group]
    } else {
        sums_big.resize(group, 0f32);
        &mut sums_big
    };
    for i in 0..group {
        let row = &mut scores[i * len..(i + 1) * len];
        let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut l = 0f32;
        for x in row.iter_mut() {
            *x = (*x - m).exp();
            l += *x;
        }
        sums[i] = l;
    }
    for j in 0..len {
        let v = &vc[base(j)..base(j) + hd];
        for i in 0..group {
            let w = scores[i * len + j];
            for (a, &x) in acc[i * hd..(i + 1) * hd].iter_mut().zip(v) {
                *a += w * x.to_f32();
            }
        }
    }
    for i in 0..group {
        let inv = 1.0 / sums[i];
        for (o, &a) in out[i * hd..(i + 1) * hd]
            .iter_mut()
            .zip(&acc[i * hd..(i + 1) * hd])
        {
            *o = E::from_f32(a * inv);
        }
    }
}

multiversion!(attend_auto => attend_body<E: Elem>(
    q: &[E], kc: &[E], vc: &[E], p: &Task<'_>, scores: &mut [f32], acc: &mut [f32], out: &mut [E]
));

#[cfg(test)]
mod tests {
    use super::*;

    /// Softmax attention of one query head over explicit key/value rows, in f64.
    fn naive(q: &[f32], keys: &[&[f32]], vals: &[&[f32]], scale: f64) -> Vec<f64> {
        let s: Vec<f64> = keys
            .iter()
            .map(|k| {
                q.iter()
                    .zip(*k)
                    .map(|(a, b)| f64::from(*a) * f64::from(*b))
                    .sum::<f64>()
                    * scale
            })
            .collect();
        let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
        let z: f64 = e.iter().sum();
        (0..q.len())
            .map(|c| {
                e.iter()
                    .zip(vals)
                    .map(|(w, v)| w * f64::from(v[c]))
                    .sum::<f64>()
                    / z
            })
            .collect()
    }

    #[test]
    fn matches_naive_attention_through_block_tables() {
        let d = AttnDims {
            num_seqs: 2,
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 8,
            num_blocks: 5,
            block_size: 3,
            max_blocks: 3,
        };
        let cache = d.num_blocks * d.block_size * d.num_kv_heads * d.head_dim;
        let kc: Vec<f32> = (0..cache)
            .map(|i| ((i * 13 % 17) as f32 - 8.0) / 9.0)
            .collect();
        let vc: Vec<f32> = (0..cache)
            .map(|i| ((i * 7 % 11) as f32 - 5.0) / 4.0)
            .collect();
        let q: Vec<f32> = (0..2 * 4 * 8)
            .map(|i| ((i * 5 % 9) as f32 - 4.0) / 3.0)
            .collect();
        let tables = [4i64, 0, 2, 1, 3, 0];
        let lens = [7i32, 4];
        let mut out = vec![0f32; q.len()];
        paged_decode_attention(&q, &kc, &vc, &tables, &lens, 0.35, d, &mut out).unwrap();
        for s in 0..2 {
            let row = |c: &[f32], j: usize, g: usize| {
                let b = tables[s * 3 + j / 3] as usize;
                let at = ((b * 3 + j % 3) * 2 + g) * 8;
                c[at..at + 8].to_vec()
            };
            for hh in 0..4 {
                let g = hh / 2;
                let ks: Vec<Vec<f32>> = (0..lens[s] as usize).map(|j| row(&kc, j, g)).collect();
                let vs: Vec<Vec<f32>> = (0..lens[s] as usize).map(|j| row(&vc, j, g)).collect();
                let kr: Vec<&[f32]> = ks.iter().map(Vec::as_slice).collect();
                let vr: Vec<&[f32]> = vs.iter().map(Vec::as_slice).collect();
                let qh = &q[(s * 4 + hh) * 8..(s * 4 + hh + 1) * 8];
                let want = naive(qh, &kr, &vr, 0.35);
                for c in 0..8 {
                    let got = f64::from(out[(s * 4 + hh) * 8 + c]);
                    assert!(
                        (got - want[c]).abs() < 1e-5,
                        "s{s} h{hh} c{c}: {got} vs {}",
                        want[c]
                    );
                }
            }
        }
        let bad = [4i64, 0, 9, 1, 3, 0];
        assert!(paged_decode_attention(&q, &kc, &vc, &bad, &lens, 0.35, d, &mut out).is_err());
        assert!(
            paged_decode_attention(&q, &kc, &vc, &tables, &[10, 4], 0.35, d, &mut out).is_err()
        );
    }
}
