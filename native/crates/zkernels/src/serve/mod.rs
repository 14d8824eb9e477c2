//! Kernels for zserve's CPU forward (a LLaMA-family decoder over a paged KV
//! cache): RMSNorm ([`rms_norm`]), rotary embedding of the fused q/k/v rows
//! with the keys and values written to their cache slots in the same pass
//! ([`rotary_kv_write`]), and decode attention that reads the cache through
//! each sequence's block table ([`paged_decode_attention`]).
//!
//! Their readable torch references are `zserve.model.llama.rms_norm`,
//! `apply_rotary` + `KVCache.write`, and `zserve.model.attention`
//! (`paged_attention_reference`). Elements are `f32` or bfloat16 bits; all
//! arithmetic is f32, and where the reference rounds an intermediate to the
//! model dtype (bf16), so does the kernel, so RMSNorm and rotary match the
//! reference to the last bit (RMSNorm adds its squares in torch's order);
//! attention sums in its own order. Errors are
//! [`QuantError`]s, checked before anything is written.

mod attention;
#[cfg(target_arch = "x86_64")]
mod attention_avx2;
mod linear;
#[cfg(target_arch = "x86_64")]
mod linear_avx2;
#[cfg(target_arch = "x86_64")]
mod linear_gemm_avx2;
mod norm;
#[cfg(target_arch = "x86_64")]
mod norm_avx2;
mod rotary;

pub use attention::{paged_decode_attention, AttnDims};
pub use linear::linear_rows;
pub use norm::{add_rms_norm, rms_norm};
pub use rotary::{rotary_kv_write, RotaryDims};

use crate::quant::QuantError;

/// Work (multiply-adds) below which a kernel stays on the calling thread.
const PAR_WORK: usize = 1 << 17;

fn check_len(
    what: &'static str,
    got: usize,
    expected: usize,
    desc: impl FnOnce() -> String,
) -> Result<(), QuantError> {
    if got == expected {
        Ok(())
    } else {
        Err(QuantError::Shape {
            what,
            expected_desc: desc(),
            expected,
            got,
        })
    }
}

fn param(name: &'static str, value: i64, expected: &'static str) -> QuantError {
    QuantError::Param {
        name,
        value,
        expected,
    }
}

/// Runs `f(task)` for `tasks` tasks, on the kernels' team ([`crate::team`], the
/// caller taking part) when `work` is worth it.
fn for_tasks<F: Fn(usize) + Sync + Send>(tasks: usize, work: usize, f: F) {
    if work < PAR_WORK {
        (0..tasks).for_each(f);
        return;
    }
    crate::team::run(tasks, f);
}

/// A raw pointer that tasks share to write disjoint ranges of one buffer.
#[derive(Clone, Copy)]
struct Shared<T>(*mut T);
// SAFETY: every task writes only its own ranges (the callers check that the
// ranges of different tasks never overlap), and the buffer outlives the loop.
unsafe impl<T> Send for Shared<T> {}
unsafe impl<T> Sync for Shared<T> {}

impl<T> Shared<T> {
    /// The buffer's start (callers write only their own elements through it).
    fn ptr(&self) -> *mut T {
        self.0
    }

    /// The sub-slice `start..start + len`.
    ///
    /// # Safety
    /// The range must lie inside the buffer and be used by one task only.
    #[allow(clippy::mut_from_ref)]
    unsafe fn range(&self, start: usize, len: usize) -> &mut [T] {
        // SAFETY: the caller guarantees the range is in bounds and unshared.
        unsafe { std::slice::from_raw_parts_mut(self.0.add(start), len) }
    }
}

/// `sum(a[i] * b[i])` in 16 f32 lanes (vectorizes under the SIMD variants).
#[inline(always)]
fn dot<E: crate::Elem>(a: &[f32], b: &[E]) -> f32 {
    let mut lanes = [0f32; 16];
    let n = a.len().min(b.len());
    let full = n / 16 * 16;
    for (ca, cb) in a[..full].chunks_exact(16).zip(b[..full].chunks_exact(16)) {
        for l in 0..16 {
            lanes[l] += ca[l] * cb[l].to_f32();
        }
    }
    let mut tail = 0f32;
    for i in full..n {
        tail += a[i] * b[i].to_f32();
    }
    lanes.iter().sum::<f32>() + tail
}
