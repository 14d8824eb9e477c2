//! GMAC/s of the serving linears (INT8 W8A8, INT4 dequant, bf16 and f32 rows) at the active
//! SIMD level, SmolLM2-135M's shapes at 1-256 activation rows, best of 7 x 0.15 s of the calling
//! thread's CPU time (on Linux; with one kernel thread that is all the work, and a loaded
//! host's waits for a core are left out: wall time there measured the load), and at one
//! row the weight bytes read per second beside the calling thread's read bandwidth
//! (`bw`: a 256 MiB buffer summed front to back):
//! `ZNATIVE_NUM_THREADS=1 ZNATIVE_SIMD=avx2 cargo run --release --example kbench [int8|int8o|int4|int4d|fp6|bf16|f32|bw|attn|norm]`
//! (`int4` also times `dequant_linear_a8`, the activations quantized to INT8, as `int4a8`; `int4d` both at 1-16 rows on every SmolLM2 projection shape; `fp6`: per-channel FP6 e3m2; `norm`: RMSNorm of SmolLM2's 576-wide rows, GB/s of rows read);
//! `attn`: one decode step's paged attention of a SmolLM2 layer (9 query heads, 3 KV heads of
//! 64, blocks of 16) at 96 cached tokens, microseconds a call.
//! (`benchmarks/results/serve-avx2.md`).
/// Seconds of CPU time the calling thread has used (wall time where that clock is missing, or
/// with `KBENCH_CLOCK=wall`: what a kernel on more than one thread is timed by).
fn now() -> f64 {
    use std::sync::OnceLock;
    static WALL: OnceLock<bool> = OnceLock::new();
    if *WALL.get_or_init(|| std::env::var("KBENCH_CLOCK").is_ok_and(|v| v == "wall")) {
        wall()
    } else {
        thread_cpu()
    }
}

#[cfg(target_os = "linux")]
fn thread_cpu() -> f64 {
    #[repr(C)]
    struct Timespec {
        sec: i64,
        nsec: i64,
    }
    extern "C" {
        fn clock_gettime(clock: i32, tp: *mut Timespec) -> i32;
    }
    const CLOCK_THREAD_CPUTIME_ID: i32 = 3;
    let mut t = Timespec { sec: 0, nsec: 0 };
    // SAFETY: `t` is a valid timespec for the call to write.
    unsafe { clock_gettime(CLOCK_THREAD_CPUTIME_ID, &mut t) };
    t.sec as f64 + t.nsec as f64 * 1e-9
}

#[cfg(not(target_os = "linux"))]
fn thread_cpu() -> f64 {
    wall()
}

fn wall() -> f64 {
    use std::sync::OnceLock;
    use std::time::Instant;
    static START: OnceLock<Instant> = OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_secs_f64()
}
use zkernels::quant::{
    dequant_linear, dequant_linear_a8, int8_linear, int8_linear_outliers, PackedWeight,
    WeightFormat,
};
use zkernels::serve::{linear_rows, paged_decode_attention, rms_norm, AttnDims};

fn best<F: FnMut()>(mut f: F, macs: usize) -> f64 {
    f();
    let mut best = f64::MAX;
    for _ in 0..7 {
        let t = now();
        let mut reps = 0;
        while now() - t < 0.15 {
            f();
            reps += 1;
        }
        best = best.min((now() - t) / reps as f64);
    }
    macs as f64 / best / 1e9
}

/// GB/s of the kernels' team (`ZNATIVE_NUM_THREADS`) summing a 256 MiB buffer (never in
/// cache), each thread one contiguous part front to back (time it with `KBENCH_CLOCK=wall`).
fn read_bandwidth() -> f64 {
    let buf: Vec<u64> = (0..32usize << 20).map(|i| i as u64).collect();
    let mut sink = 0u64;
    let bytes = buf.len() * 8;
    let gmacs = best(
        || {
            let parts = zkernels::team::threads();
            let len = buf.len().div_ceil(parts);
            let total = std::sync::atomic::AtomicU64::new(0);
            zkernels::team::run(parts, |p| {
                let mut lanes = [0u64; 8];
                for c in buf[p * len..((p + 1) * len).min(buf.len())].chunks_exact(8) {
                    for l in 0..8 {
                        lanes[l] = lanes[l].wrapping_add(c[l]);
                    }
                }
                let s = lanes.iter().fold(0u64, |a, v| a.wrapping_add(*v));
                total.fetch_add(s, std::sync::atomic::Ordering::Relaxed);
            });
            sink = sink.wrapping_add(total.into_inner());
        },
        bytes,
    );
    std::hint::black_box(sink);
    gmacs
}

/// Weight GB/s of a one-row product at `gmacs` GMAC/s over `bytes` bytes of weight.
fn gbs(m: usize, gmacs: f64, macs: usize, bytes: usize) -> String {
    if m == 1 {
        format!(
            "  ({:.1} GB/s of weight)",
            gmacs * bytes as f64 / macs as f64
        )
    } else {
        String::new()
    }
}

fn main() {
    let only = std::env::args().nth(1).unwrap_or_default();
    println!("level {}", zkernels::simd::active().name());
    if only.is_empty() || only == "bw" {
        let t = zkernels::team::threads();
        println!(
            "read  {t} thread(s), 256 MiB: {:7.2} GB/s",
            read_bandwidth()
        );
    }
    if only.is_empty() || only == "attn" {
        attention();
    }
    if only.is_empty() || only == "norm" {
        norm();
    }
    if only == "int4d" {
        int4_decode();
        return;
    }
    for &(m, n, k) in &[
        (1, 49152, 576),
        (1, 1536, 576),
        (2, 1536, 576),
        (4, 1536, 576),
        (8, 1536, 576),
        (16, 1536, 576),
        (64, 1536, 576),
        (256, 1536, 576),
    ] {
        // `KBENCH_ROWS=64`: that row count alone (to profile one shape).
        if std::env::var("KBENCH_ROWS").is_ok_and(|r| r.parse() != Ok(m)) {
            continue;
        }
        let x: Vec<f32> = (0..m * k)
            .map(|i| ((i * 13 % 17) as f32 - 8.0) / 5.0)
            .collect();
        let macs = m * n * k;
        let mut out = vec![0f32; m * n];
        if only.is_empty() || only == "int8" {
            let w: Vec<i8> = (0..n * k)
                .map(|i| ((i * 7 % 255) as i32 - 127) as i8)
                .collect();
            let ws = vec![0.01f32; n];
            let g = best(
                || int8_linear(&x, &w, &ws, None, &mut out, m, n, k).unwrap(),
                macs,
            );
            let wb = gbs(m, g, macs, n * k + 4 * n);
            println!("int8  m={m:3} n={n:5} k={k}: {g:7.2} GMAC/s{wb}");
        }
        if only == "int8" || only == "int8o" {
            // W8A8 with the recipe's 8 outlier channels kept in float32 (fused split).
            let w: Vec<i8> = (0..n * k)
                .map(|i| ((i * 7 % 255) as i32 - 127) as i8)
                .collect();
            let ws = vec![0.01f32; n];
            let g = best(
                || int8_linear_outliers(&x, &w, &ws, None, &mut out, m, n, k, 8).unwrap(),
                macs,
            );
            println!("int8o m={m:3} n={n:5} k={k}: {g:7.2} GMAC/s (8 outlier channels)");
        }
        if only.is_empty() || only == "int4" {
            let data: Vec<u8> = (0..n * k / 2).map(|i| (i * 31) as u8).collect();
            let groups = k / 32;
            let scale = vec![0.01f32; n * groups];
            let zero = vec![8f32; n * groups];
            let w = PackedWeight {
                zero: Some(&zero),
                ..PackedWeight::int4(&data, &scale, n, k, 32)
            };
            let g = best(|| dequant_linear(&x, &w, None, &mut out, m).unwrap(), macs);
            let wb = gbs(m, g, macs, n * k / 2 + 8 * n * groups);
            println!("int4  m={m:3} n={n:5} k={k}: {g:7.2} GMAC/s{wb}");
            let w = PackedWeight { zero: None, ..w };
            let g = best(
                || dequant_linear_a8(&x, &w, None, &mut out, m).unwrap(),
                macs,
            );
            let wb = gbs(m, g, macs, n * k / 2 + 4 * n * groups);
            println!("int4a8 m={m:3} n={n:5} k={k}: {g:7.2} GMAC/s{wb}");
        }
        if (only.is_empty() || only == "fp6") && m <= 16 {
            let data: Vec<u8> = (0..n * k / 2).map(|i| (i * 31) as u8).collect();
            let data2: Vec<u8> = (0..n * k / 4).map(|i| (i * 17) as u8).collect();
            let scale = vec![0.01f32; n];
            let w = PackedWeight {
                format: WeightFormat::Fp6,
                data: &data,
                data2: Some(&data2),
                scale: &scale,
                zero: None,
                n,
                k,
                group: k,
            };
            let g = best(|| dequant_linear(&x, &w, None, &mut out, m).unwrap(), macs);
            let wb = gbs(m, g, macs, n * k * 3 / 4 + 4 * n);
            println!("fp6   m={m:3} n={n:5} k={k}: {g:7.2} GMAC/s{wb}");
        }
        if only.is_empty() || only == "bf16" {
            let xb: Vec<u16> = x.iter().map(|v| zkernels::bf16::f32_to_bf16(*v)).collect();
            let w: Vec<u16> = (0..n * k)
                .map(|i| zkernels::bf16::f32_to_bf16(((i * 7 % 11) as f32 - 5.0) / 9.0))
                .collect();
            let mut ob = vec![0u16; m * n];
            let g = best(|| linear_rows(&xb, &w, m, &mut ob).unwrap(), macs);
            let wb = gbs(m, g, macs, 2 * n * k);
            println!("bf16  m={m:3} n={n:5} k={k}: {g:7.2} GMAC/s{wb}");
        }
        if only.is_empty() || only == "f32" {
            let w: Vec<f32> = (0..n * k)
                .map(|i| ((i * 7 % 11) as f32 - 5.0) / 9.0)
                .collect();
            let g = best(|| linear_rows(&x, &w, m, &mut out).unwrap(), macs);
            let wb = gbs(m, g, macs, 4 * n * k);
            println!("f32   m={m:3} n={n:5} k={k}: {g:7.2} GMAC/s{wb}");
        }
    }
}

/// Microseconds of one SmolLM2 layer's decode attention (one sequence, 96 keys), f32 and bf16.
/// `int4d`: the INT4 float path and `dequant_linear_a8` at a decode step's rows (1, 2, 4, 16)
/// on SmolLM2's projection shapes (symmetric, groups of 32, as the served W4 directories).
fn int4_decode() {
    for &(n, k) in &[
        (576, 576),
        (1536, 576),
        (576, 1536),
        (192, 576),
        (49152, 576),
    ] {
        for m in [1, 2, 4, 16] {
            if std::env::var("KBENCH_ROWS").is_ok_and(|r| r.parse() != Ok(m)) {
                continue;
            }
            let x: Vec<f32> = (0..m * k)
                .map(|i| ((i * 13 % 17) as f32 - 8.0) / 5.0)
                .collect();
            let mut out = vec![0f32; m * n];
            let data: Vec<u8> = (0..n * k / 2).map(|i| (i * 31) as u8).collect();
            let scale = vec![0.01f32; n * k / 32];
            let w = PackedWeight::int4(&data, &scale, n, k, 32);
            let macs = m * n * k;
            let f = best(|| dequant_linear(&x, &w, None, &mut out, m).unwrap(), macs);
            let a = best(
                || dequant_linear_a8(&x, &w, None, &mut out, m).unwrap(),
                macs,
            );
            println!("int4d m={m:2} {n:5}x{k:4}: float {f:7.2}  a8 {a:7.2} GMAC/s");
        }
    }
}

fn attention() {
    let d = AttnDims {
        num_seqs: 1,
        num_heads: 9,
        num_kv_heads: 3,
        head_dim: 64,
        num_blocks: 8,
        block_size: 16,
        max_blocks: 8,
    };
    let cache = d.num_blocks * d.block_size * d.num_kv_heads * d.head_dim;
    let kc: Vec<f32> = (0..cache)
        .map(|i| ((i * 13 % 17) as f32 - 8.0) / 9.0)
        .collect();
    let vc: Vec<f32> = (0..cache)
        .map(|i| ((i * 7 % 11) as f32 - 5.0) / 4.0)
        .collect();
    let q: Vec<f32> = (0..9 * 64)
        .map(|i| ((i * 5 % 9) as f32 - 4.0) / 3.0)
        .collect();
    let tables: Vec<i64> = (0..8).rev().collect();
    let lens = [96i32];
    let mut out = vec![0f32; q.len()];
    // `best` reports units per second; one unit a call gives calls per second.
    let calls = best(
        || paged_decode_attention(&q, &kc, &vc, &tables, &lens, 0.125, d, &mut out).unwrap(),
        1,
    );
    println!(
        "attn  f32  9/3 heads x 64, 96 keys: {:7.2} us/call",
        1e-3 / calls
    );
    let b = |v: &[f32]| -> Vec<u16> { v.iter().map(|x| zkernels::bf16::f32_to_bf16(*x)).collect() };
    let (kb, vb, qb) = (b(&kc), b(&vc), b(&q));
    let mut ob = vec![0u16; q.len()];
    let calls = best(
        || paged_decode_attention(&qb, &kb, &vb, &tables, &lens, 0.125, d, &mut ob).unwrap(),
        1,
    );
    println!(
        "attn  bf16 9/3 heads x 64, 96 keys: {:7.2} us/call",
        1e-3 / calls
    );
}

/// GB/s (of rows read) of RMSNorm over 1 and 64 rows of 576, f32 and bf16.
fn norm() {
    let h = 576;
    for rows in [1usize, 64] {
        let x: Vec<f32> = (0..rows * h)
            .map(|i| ((i * 13 % 17) as f32 - 8.0) / 5.0)
            .collect();
        let w: Vec<f32> = (0..h).map(|i| 0.5 + i as f32 / 600.0).collect();
        let mut out = vec![0f32; x.len()];
        let g = best(|| rms_norm(&x, &w, 1e-5, &mut out).unwrap(), 4 * x.len());
        println!("norm  f32  {rows:2} x {h}: {g:7.2} GB/s");
        let b =
            |v: &[f32]| -> Vec<u16> { v.iter().map(|x| zkernels::bf16::f32_to_bf16(*x)).collect() };
        let (xb, wb) = (b(&x), b(&w));
        let mut ob = vec![0u16; xb.len()];
        let g = best(|| rms_norm(&xb, &wb, 1e-5, &mut ob).unwrap(), 2 * x.len());
        println!("norm  bf16 {rows:2} x {h}: {g:7.2} GB/s");
    }
}
