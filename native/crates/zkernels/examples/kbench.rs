//! GMAC/s of the serving linears (INT8 W8A8, INT4 dequant, bf16 and f32 rows) at the active
//! SIMD level, SmolLM2-135M's shapes at 1-256 activation rows, best of 7 x 0.15 s:
//! `ZNATIVE_NUM_THREADS=1 ZNATIVE_SIMD=avx2 cargo run --release --example kbench [int8|int4|bf16|f32]`
//! (`benchmarks/results/serve-avx2.md`).
use std::time::Instant;
use zkernels::quant::{dequant_linear, int8_linear, PackedWeight, WeightFormat};
use zkernels::serve::linear_rows;

fn best<F: FnMut()>(mut f: F, macs: usize) -> f64 {
    f();
    let mut best = f64::MAX;
    for _ in 0..7 {
        let t = Instant::now();
        let mut reps = 0;
        while t.elapsed().as_secs_f64() < 0.15 {
            f();
            reps += 1;
        }
        best = best.min(t.elapsed().as_secs_f64() / reps as f64);
    }
    macs as f64 / best / 1e9
}

fn main() {
    let only = std::env::args().nth(1).unwrap_or_default();
    println!("level {}", zkernels::simd::active().name());
    for &(m, n, k) in &[
        (1, 49152, 576),
        (1, 1536, 576),
        (4, 1536, 576),
        (16, 1536, 576),
        (64, 1536, 576),
        (256, 1536, 576),
    ] {
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
            println!("int8  m={m:3} n={n:5} k={k}: {g:7.2} GMAC/s");
        }
        if only.is_empty() || only == "int4" {
            let data: Vec<u8> = (0..n * k / 2).map(|i| (i * 31) as u8).collect();
            let groups = k / 32;
            let scale = vec![0.01f32; n * groups];
            let zero = vec![8f32; n * groups];
            let w = PackedWeight {
                format: WeightFormat::Int4 { offset: 8 },
                data: &data,
                data2: None,
                scale: &scale,
                zero: Some(&zero),
                n,
                k,
                group: 32,
            };
            let g = best(|| dequant_linear(&x, &w, None, &mut out, m).unwrap(), macs);
            println!("int4  m={m:3} n={n:5} k={k}: {g:7.2} GMAC/s");
        }
        if (only.is_empty() || only == "bf16") && m <= 64 {
            let xb: Vec<u16> = x.iter().map(|v| zkernels::bf16::f32_to_bf16(*v)).collect();
            let w: Vec<u16> = (0..n * k)
                .map(|i| zkernels::bf16::f32_to_bf16(((i * 7 % 11) as f32 - 5.0) / 9.0))
                .collect();
            let mut ob = vec![0u16; m * n];
            let g = best(|| linear_rows(&xb, &w, m, &mut ob).unwrap(), macs);
            println!("bf16  m={m:3} n={n:5} k={k}: {g:7.2} GMAC/s");
        }
        if (only.is_empty() || only == "f32") && m <= 64 {
            let w: Vec<f32> = (0..n * k)
                .map(|i| ((i * 7 % 11) as f32 - 5.0) / 9.0)
                .collect();
            let g = best(|| linear_rows(&x, &w, m, &mut out).unwrap(), macs);
            println!("f32   m={m:3} n={n:5} k={k}: {g:7.2} GMAC/s");
        }
    }
}
