//! Round trips through real files on disk: unaligned sizes and offsets,
//! misaligned (bounced) buffers, many requests in flight, both backends and
//! every scheduling knob.

mod common;

use common::{backends, engine, file_bytes, pattern, Scratch};
use zaio::{AioConfig, AlignedBuffer, BackendKind, Engine, Op};

const SIZES: [usize; 7] = [
    0,
    1,
    4095,
    4096,
    4097,
    (1 << 20) + 3,
    3 * (1 << 20) + 4096 * 3,
];

#[test]
fn aligned_buffers_round_trip_every_size() {
    for backend in backends() {
        let dir = Scratch::new("sizes");
        let e = engine(backend, 1 << 20, 8);
        for (i, &n) in SIZES.iter().enumerate() {
            let data = pattern(n, i as u64);
            let mut src = AlignedBuffer::new(n).unwrap();
            src.as_mut_slice().copy_from_slice(&data);
            let p = dir.path(&format!("f{i}"));
            assert_eq!(e.write(&p, src.as_slice(), 0).unwrap(), n);
            assert_eq!(file_bytes(&p), data, "{backend:?} size {n}: file content");
            let mut dst = AlignedBuffer::new(n).unwrap();
            assert_eq!(e.read(&p, dst.as_mut_slice(), 0).unwrap(), n);
            assert_eq!(dst.as_slice(), &data[..], "{backend:?} size {n}: read back");
        }
        let st = e.stats();
        assert_eq!(st.bounced, 0, "aligned buffers are never bounced");
        // Sizes 4096 and up have an aligned middle, written and read with O_DIRECT.
        assert_eq!(st.direct, 2 * 4, "{st:?}");
        assert_eq!(st.direct_refused, 0, "{:?}", st.last_direct_refused);
    }
}

#[test]
fn unaligned_offsets_and_misaligned_buffers_round_trip() {
    for backend in backends() {
        let dir = Scratch::new("offsets");
        let e = engine(backend, 64 << 10, 4);
        let p = dir.path("f");
        let whole = pattern(300_000, 7);
        e.write(&p, &whole, 0).unwrap();
        // Overwrite pieces at odd offsets from buffers at odd addresses.
        let mut expect = whole.clone();
        for (k, (off, n)) in [(100u64, 5000usize), (8192, 70_001), (12_345, 200_000)]
            .into_iter()
            .enumerate()
        {
            let mut raw = pattern(n + 3, 100 + k as u64);
            let src = &mut raw[3..];
            e.write(&p, src, off).unwrap();
            expect[off as usize..off as usize + n].copy_from_slice(src);
            assert_eq!(file_bytes(&p), expect, "{backend:?} write at {off}");
            let mut back = vec![0u8; n + 1];
            e.read(&p, &mut back[1..], off).unwrap();
            assert_eq!(&back[1..], &expect[off as usize..off as usize + n]);
        }
        assert!(
            e.stats().bounced > 0,
            "misaligned buffers took the bounce path"
        );
    }
}

#[test]
fn many_requests_in_flight_on_many_files() {
    for backend in backends() {
        let dir = Scratch::new("many");
        let e = Engine::new(AioConfig {
            block_size: 16 << 10,
            queue_depth: 32,
            intra_op_parallelism: 2,
            backend,
            ..AioConfig::default()
        })
        .unwrap();
        let n_files = 64;
        let bufs: Vec<AlignedBuffer> = (0..n_files)
            .map(|i| {
                let data = pattern(50_000 + i * 4096 + i, i as u64);
                let mut b = AlignedBuffer::unlocked(data.len()).unwrap();
                b.as_mut_slice().copy_from_slice(&data);
                b
            })
            .collect();
        let ids: Vec<u64> = bufs
            .iter()
            .enumerate()
            .map(|(i, b)| {
                let p = dir.path(&format!("f{i}"));
                // SAFETY: `bufs` outlives the waits below.
                unsafe { e.submit(Op::Write, &p, b.as_ptr().cast_mut(), b.len(), 0) }.unwrap()
            })
            .collect();
        for (id, b) in ids.iter().zip(&bufs) {
            assert_eq!(e.wait(*id).unwrap(), b.len());
        }
        let mut outs: Vec<AlignedBuffer> = bufs
            .iter()
            .map(|b| AlignedBuffer::unlocked(b.len()).unwrap())
            .collect();
        for (i, o) in outs.iter_mut().enumerate() {
            let p = dir.path(&format!("f{i}"));
            // SAFETY: `outs` is not touched until wait_all returns.
            unsafe { e.submit(Op::Read, &p, o.as_mut_ptr(), o.len(), 0) }.unwrap();
        }
        let results = e.wait_all();
        assert_eq!(results.len(), n_files);
        assert!(results.iter().all(|(_, r)| r.is_ok()));
        for (b, o) in bufs.iter().zip(&outs) {
            assert_eq!(b.as_slice(), o.as_slice());
        }
    }
}

#[test]
fn scheduling_knobs_all_round_trip() {
    let Ok(()) = zaio::probe_io_uring() else {
        eprintln!("skipping: io_uring unavailable");
        return;
    };
    let data = pattern((5 << 20) + 17, 3);
    for (single_submit, overlap_events, par) in
        [(true, true, 1), (false, false, 3), (true, false, 2)]
    {
        let dir = Scratch::new("knobs");
        let e = Engine::new(AioConfig {
            block_size: 256 << 10,
            queue_depth: 4,
            intra_op_parallelism: par,
            single_submit,
            overlap_events,
            backend: BackendKind::IoUring,
        })
        .unwrap();
        let mut src = AlignedBuffer::unlocked(data.len()).unwrap();
        src.as_mut_slice().copy_from_slice(&data);
        let p = dir.path("big");
        e.write(&p, src.as_slice(), 0).unwrap();
        let mut dst = AlignedBuffer::unlocked(data.len()).unwrap();
        e.read(&p, dst.as_mut_slice(), 0).unwrap();
        assert_eq!(dst.as_slice(), &data[..]);
    }
}

#[test]
fn writes_never_truncate_and_extend_exactly() {
    for backend in backends() {
        let dir = Scratch::new("extend");
        let e = engine(backend, 1 << 20, 8);
        let p = dir.path("f");
        e.write(&p, &pattern(10_000, 1), 0).unwrap();
        e.write(&p, &[7u8; 10], 4).unwrap();
        let got = file_bytes(&p);
        assert_eq!(
            got.len(),
            10_000,
            "a write inside the file keeps its length"
        );
        assert_eq!(&got[4..14], &[7u8; 10]);
        e.write(&p, &[9u8; 5000], 20_000).unwrap();
        assert_eq!(
            file_bytes(&p).len(),
            25_000,
            "a write past the end extends to its end"
        );
    }
}

#[test]
fn tmpfs_refuses_o_direct_and_falls_back_to_buffered() {
    let shm = std::path::Path::new("/dev/shm");
    if !shm.is_dir() {
        eprintln!("skipping: no /dev/shm");
        return;
    }
    let p = shm.join(format!("zaio-test-{}", std::process::id()));
    let e = engine(BackendKind::Threads, 1 << 20, 8);
    let data = pattern(1 << 16, 5);
    let mut src = AlignedBuffer::unlocked(data.len()).unwrap();
    src.as_mut_slice().copy_from_slice(&data);
    let r = e.write(&p, src.as_slice(), 0);
    let back = std::fs::read(&p);
    let _ = std::fs::remove_file(&p);
    assert_eq!(r.unwrap(), data.len());
    assert_eq!(back.unwrap(), data);
    let st = e.stats();
    // tmpfs gained O_DIRECT support in Linux 6.6; older kernels refuse it.
    if st.direct_refused > 0 {
        assert!(st.last_direct_refused.unwrap().contains("O_DIRECT refused"));
    }
}
