//! Rotary embedding of the q and k heads of fused `qkv` rows, in place, and
//! the keys (rotated) and values written to their KV-cache slots in the same
//! pass. `rotate_half` layout, as `zserve.model.llama.apply_rotary`:
//! `x * cos + cat(-x2, x1) * sin`, each product and the sum rounded to the
//! element type (exact for f32, the reference's bf16 rounding for bf16).

use super::{check_len, for_tasks, param, Shared};
use crate::bf16::Elem;
use crate::quant::QuantError;
use crate::simd::multiversion;

/// Shapes of [`rotary_kv_write`].
#[derive(Clone, Copy, Debug)]
pub struct RotaryDims {
    /// Packed tokens T (rows of `qkv`).
    pub tokens: usize,
    /// Query heads H; `qkv` rows are `[H q heads | KV k heads | KV v heads]`.
    pub num_heads: usize,
    /// Key/value heads KV.
    pub num_kv_heads: usize,
    /// Elements per head D (even).
    pub head_dim: usize,
    /// Rows of the `cos`/`sin` tables (positions).
    pub max_positions: usize,
    /// Slots of each cache (`num_blocks * block_size`).
    pub num_slots: usize,
}

/// Rotates the q and k heads of `qkv` `(T, (H + 2 KV) * D)` by the `cos`/`sin`
/// rows `(max_positions, D)` of each token's position, then copies each token's
/// k and v heads into `k_cache`/`v_cache` `(num_slots, KV, D)` at its slot.
#[allow(clippy::too_many_arguments)]
pub fn rotary_kv_write<E: Elem>(
    qkv: &mut [E],
    cos: &[E],
    sin: &[E],
    positions: &[i64],
    slots: &[i64],
    d: RotaryDims,
    k_cache: &mut [E],
    v_cache: &mut [E],
) -> Result<(), QuantError> {
    let hd = d.head_dim;
    if hd == 0 || !hd.is_multiple_of(2) {
        return Err(param("head_dim", hd as i64, "an even head_dim >= 2"));
    }
    let stride = (d.num_heads + 2 * d.num_kv_heads) * hd;
    let kvw = d.num_kv_heads * hd;
    check_len("qkv", qkv.len(), d.tokens * stride, || {
        format!("tokens * (heads + 2 kv_heads) * head_dim for {d:?}")
    })?;
    for (what, t) in [("cos", cos.len()), ("sin", sin.len())] {
        check_len(what, t, d.max_positions * hd, || {
            "max_positions * head_dim".into()
        })?;
    }
    check_len("positions", positions.len(), d.tokens, || "tokens".into())?;
    check_len("slots", slots.len(), d.tokens, || "tokens".into())?;
    for (what, c) in [("k_cache", k_cache.len()), ("v_cache", v_cache.len())] {
        check_len(what, c, d.num_slots * kvw, || {
            "num_slots * kv_heads * head_dim".into()
        })?;
    }
    if let Some(&p) = positions
        .iter()
        .find(|&&p| p < 0 || p as usize >= d.max_positions)
    {
        return Err(param("position", p, "in [0, max_positions)"));
    }
    if let Some(&s) = slots.iter().find(|&&s| s < 0 || s as usize >= d.num_slots) {
        return Err(param("slot", s, "in [0, num_slots)"));
    }
    let mut sorted = slots.to_vec();
    sorted.sort_unstable();
    if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
        return Err(param("slot", w[0], "each slot written by one token only"));
    }
    let (q, kc, vc) = (
        Shared(qkv.as_mut_ptr()),
        Shared(k_cache.as_mut_ptr()),
        Shared(v_cache.as_mut_ptr()),
    );
    let rot = d.num_heads + d.num_kv_heads;
    for_tasks(d.tokens, d.tokens * stride, |t| {
        let p = positions[t] as usize;
        let s = slots[t] as usize;
        // SAFETY: token t owns row t of qkv and slot s of each cache (slots are unique).
        let row = unsafe { q.range(t * stride, stride) };
        let (c, sn) = (&cos[p * hd..(p + 1) * hd], &sin[p * hd..(p + 1) * hd]);
        for h in 0..rot {
            rotate_auto(&mut row[h * hd..(h + 1) * hd], c, sn);
        }
        let (k_dst, v_dst) = unsafe { (kc.range(s * kvw, kvw), vc.range(s * kvw, kvw)) };
        k_dst.copy_from_slice(&row[d.num_heads * hd..rot * hd]);
        v_dst.copy_from_slice(&row[rot * hd..]);
    });
    Ok(())
}

#[inline(always)]
fn rotate_body<E: Elem>(x: &mut [E], cos: &[E], sin: &[E]) {
    let half = x.len() / 2;
    let (lo, hi) = x.split_at_mut(half);
    let r = |v: f32| E::from_f32(v).to_f32();
    for i in 0..half {
        let (a, b) = (lo[i].to_f32(), hi[i].to_f32());
        let (c0, c1) = (cos[i].to_f32(), cos[i + half].to_f32());
        let (s0, s1) = (sin[i].to_f32(), sin[i + half].to_f32());
        lo[i] = E::from_f32(r(a * c0) + r(-b * s0));
        hi[i] = E::from_f32(r(b * c1) + r(a * s1));
    }
}

multiversion!(rotate_auto => rotate_body<E: Elem>(x: &mut [E], cos: &[E], sin: &[E]));

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotates_and_writes_slots() {
        let d = RotaryDims {
            tokens: 2,
            num_heads: 2,
            num_kv_heads: 1,
            head_dim: 4,
            max_positions: 3,
            num_slots: 4,
        };
        let mut qkv: Vec<f32> = (0..2 * 16).map(|i| i as f32).collect();
        let orig = qkv.clone();
        let cos: Vec<f32> = (0..12).map(|i| (i as f32 * 0.3).cos()).collect();
        let sin: Vec<f32> = (0..12).map(|i| (i as f32 * 0.3).sin()).collect();
        let (mut kc, mut vc) = (vec![0f32; 16], vec![0f32; 16]);
        rotary_kv_write(&mut qkv, &cos, &sin, &[2, 0], &[3, 1], d, &mut kc, &mut vc).unwrap();
        for t in 0..2 {
            let p = [2usize, 0][t];
            for h in 0..3 {
                for i in 0..4 {
                    let x = &orig[t * 16 + h * 4..t * 16 + h * 4 + 4];
                    let rot = if i < 2 { -x[i + 2] } else { x[i - 2] };
                    let want = x[i] * cos[p * 4 + i] + rot * sin[p * 4 + i];
                    assert_eq!(qkv[t * 16 + h * 4 + i], want);
                }
            }
        }
        assert_eq!(&kc[12..16], &qkv[8..12]); // token 0's k at slot 3
        assert_eq!(&vc[4..8], &orig[28..32]); // token 1's v at slot 1
        assert!(
            rotary_kv_write(&mut qkv, &cos, &sin, &[0, 0], &[1, 1], d, &mut kc, &mut vc).is_err()
        );
        assert!(
            rotary_kv_write(&mut qkv, &cos, &sin, &[3, 0], &[0, 1], d, &mut kc, &mut vc).is_err()
        );
    }
}
