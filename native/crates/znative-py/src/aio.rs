//! Async file IO exposed to Python: `AioHandle` over `zaio::Engine`,
//! `aligned_buffer` and `io_backend_probe`.
//!
//! Buffers are numpy arrays of any non-object dtype, C-contiguous, taken as
//! raw bytes (`tensor.view(torch.uint8).numpy()` or `tensor.numpy()`). An
//! async request keeps a reference to its array until it is waited on, so the
//! memory cannot be freed under the IO. Every call that can block (open,
//! submit, wait) runs with the GIL released.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Mutex, PoisonError};

use numpy::npyffi::NPY_ARRAY_WRITEABLE;
use numpy::{ndarray, PyArray1, PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::PyMemoryError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use zaio::{AioConfig, AlignedBuffer, BackendKind, Engine, Op};

use crate::errors::{aio_to_py, DTypeError, LayoutError};
use crate::inflight;

/// Address and byte length of a checked numpy buffer.
#[derive(Clone, Copy)]
struct Raw {
    ptr: usize,
    len: usize,
}

fn raw_buffer(obj: &Bound<'_, PyAny>, writeable: bool) -> PyResult<Raw> {
    let a = obj.cast::<PyUntypedArray>().map_err(|_| {
        DTypeError::new_err(format!(
            "buffer: expected a numpy array (a CPU tensor's `.numpy()` view), got {}",
            obj.get_type()
                .name()
                .map_or_else(|_| "?".to_string(), |n| n.to_string())
        ))
    })?;
    let dtype = a.dtype();
    if dtype.has_object() {
        return Err(DTypeError::new_err(
            "buffer: object arrays hold pointers, not data; pass a numeric array",
        ));
    }
    if !a.is_c_contiguous() {
        return Err(LayoutError::new_err(
            "buffer: not C-contiguous; IO moves one contiguous byte range, so pass `.contiguous()`",
        ));
    }
    // SAFETY: `a` is a live ndarray; its header is read, not written.
    let (data, flags) = unsafe {
        let p = a.as_array_ptr();
        ((*p).fields.data as usize, (*p).fields.flags)
    };
    if writeable && flags & NPY_ARRAY_WRITEABLE == 0 {
        return Err(LayoutError::new_err(
            "buffer: read-only array; a read needs a writeable destination",
        ));
    }
    Ok(Raw {
        ptr: data,
        len: a.len() * dtype.itemsize(),
    })
}

/// A page-aligned (4096) allocation, `mlock`ed when the limit allows; the
/// `.base` of the array `aligned_buffer` returns, freed when that array dies.
#[pyclass(module = "znative._native", frozen)]
pub struct AlignedAllocation {
    buf: AlignedBuffer,
}

#[pymethods]
impl AlignedAllocation {
    /// Bytes usable (the allocation is rounded up to whole pages).
    #[getter]
    fn nbytes(&self) -> usize {
        self.buf.len()
    }

    /// Whether `mlock` succeeded (RLIMIT_MEMLOCK allowing).
    #[getter]
    fn locked(&self) -> bool {
        self.buf.locked()
    }

    #[getter]
    fn address(&self) -> usize {
        self.buf.as_ptr() as usize
    }
}

/// A zero-filled uint8 array of `nbytes` over a 4096-aligned, best-effort
/// locked allocation (its `.base` is the `AlignedAllocation`).
#[pyfunction]
pub fn aligned_buffer(py: Python<'_>, nbytes: usize) -> PyResult<Bound<'_, PyArray1<u8>>> {
    let buf = py
        .detach(|| AlignedBuffer::new(nbytes))
        .ok_or_else(|| PyMemoryError::new_err(format!("cannot allocate {nbytes} aligned bytes")))?;
    let ptr = buf.as_ptr();
    let owner = Bound::new(py, AlignedAllocation { buf })?;
    // SAFETY: `ptr..ptr+nbytes` is owned by `owner`, which the array keeps as its base,
    // so the memory lives exactly as long as the array (and views of it).
    let view = unsafe { ndarray::ArrayView1::from_shape_ptr(nbytes, ptr) };
    Ok(unsafe { PyArray1::borrow_from_array(&view, owner.into_any()) })
}

/// What `backend="auto"` picks on this machine and why: `(name, reason)`.
#[pyfunction]
pub fn io_backend_probe(py: Python<'_>) -> (&'static str, String) {
    py.detach(zaio::io_backend_probe)
}

/// Async reads and writes of numpy buffers at file offsets (see `zaio`).
#[pyclass(module = "znative._native", frozen)]
pub struct AioHandle {
    // Declared first: dropping the engine waits for IO before `held` releases the buffers.
    engine: Engine,
    held: Mutex<HashMap<u64, Py<PyAny>>>,
}

impl Drop for AioHandle {
    fn drop(&mut self) {
        // The engine's own drop waits for the requests in flight; do that here with the
        // GIL released, so other Python threads run while a dropped handle drains.
        let engine = &self.engine;
        Python::attach(|py| py.detach(|| drop(engine.wait_all())));
        inflight::release_all(self.owner());
    }
}

impl AioHandle {
    fn submit(
        &self,
        py: Python<'_>,
        op: Op,
        buffer: &Bound<'_, PyAny>,
        path: PathBuf,
        offset: u64,
    ) -> PyResult<u64> {
        let raw = self.checked(buffer, op)?;
        let engine = &self.engine;
        // SAFETY: `buffer` is kept in `held` until the request is waited on (or the
        // engine, which waits for everything, is dropped first).
        let id = py
            .detach(|| unsafe { engine.submit(op, &path, raw.ptr as *mut u8, raw.len, offset) })
            .map_err(aio_to_py)?;
        inflight::register(self.owner(), id, raw.ptr, raw.len, op == Op::Read);
        self.held
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(id, buffer.clone().unbind());
        Ok(id)
    }

    fn run_sync(
        &self,
        py: Python<'_>,
        op: Op,
        buffer: &Bound<'_, PyAny>,
        path: PathBuf,
        offset: u64,
    ) -> PyResult<usize> {
        let raw = self.checked(buffer, op)?;
        let (engine, owner) = (&self.engine, self.owner());
        // SAFETY: `buffer` is borrowed by this call until `wait` returns; other threads
        // may run meanwhile (the GIL is released), so the range is registered too.
        py.detach(|| {
            let id = unsafe { engine.submit(op, &path, raw.ptr as *mut u8, raw.len, offset)? };
            inflight::register(owner, id, raw.ptr, raw.len, op == Op::Read);
            let r = engine.wait(id);
            inflight::release(owner, &[id]);
            r
        })
        .map_err(aio_to_py)
    }

    /// The buffer as raw bytes, refused while other IO in flight conflicts with `op`.
    fn checked(&self, buffer: &Bound<'_, PyAny>, op: Op) -> PyResult<Raw> {
        let raw = raw_buffer(buffer, op == Op::Read)?;
        match inflight::conflict(raw.ptr, raw.len, op == Op::Read) {
            Some(why) => Err(LayoutError::new_err(format!("buffer: {why}"))),
            None => Ok(raw),
        }
    }

    /// This handle's key in the in-flight registry.
    fn owner(&self) -> usize {
        &self.engine as *const Engine as usize
    }

    fn release(&self, ids: impl IntoIterator<Item = u64>) {
        let ids: Vec<u64> = ids.into_iter().collect();
        inflight::release(self.owner(), &ids);
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        for id in ids {
            held.remove(&id);
        }
    }
}

#[pymethods]
impl AioHandle {
    #[new]
    #[pyo3(signature = (block_size=1048576, queue_depth=8, intra_op_parallelism=1, single_submit=false, overlap_events=true, backend="auto"))]
    fn new(
        py: Python<'_>,
        block_size: usize,
        queue_depth: usize,
        intra_op_parallelism: usize,
        single_submit: bool,
        overlap_events: bool,
        backend: &str,
    ) -> PyResult<Self> {
        let backend: BackendKind = backend.parse().map_err(aio_to_py)?;
        let cfg = AioConfig {
            block_size,
            queue_depth,
            intra_op_parallelism,
            single_submit,
            overlap_events,
            backend,
        };
        let engine = py.detach(|| Engine::new(cfg)).map_err(aio_to_py)?;
        Ok(AioHandle {
            engine,
            held: Mutex::new(HashMap::new()),
        })
    }

    /// Starts reading `buffer.nbytes` bytes at `offset` of `path` into `buffer`; the request id.
    #[pyo3(signature = (buffer, path, offset=0))]
    fn pread(
        &self,
        py: Python<'_>,
        buffer: &Bound<'_, PyAny>,
        path: PathBuf,
        offset: u64,
    ) -> PyResult<u64> {
        self.submit(py, Op::Read, buffer, path, offset)
    }

    /// Starts writing `buffer` at `offset` of `path` (created if missing, never truncated).
    #[pyo3(signature = (buffer, path, offset=0))]
    fn pwrite(
        &self,
        py: Python<'_>,
        buffer: &Bound<'_, PyAny>,
        path: PathBuf,
        offset: u64,
    ) -> PyResult<u64> {
        self.submit(py, Op::Write, buffer, path, offset)
    }

    /// Blocks until request `id` (or, with `None`, every pending request) is
    /// done; bytes transferred. With `None`, the first error is raised after all finished.
    #[pyo3(signature = (id=None))]
    fn wait(&self, py: Python<'_>, id: Option<u64>) -> PyResult<usize> {
        let engine = &self.engine;
        match id {
            Some(id) => {
                let r = py.detach(|| engine.wait(id));
                self.release([id]);
                r.map_err(aio_to_py)
            }
            None => {
                let all = py.detach(|| engine.wait_all());
                self.release(all.iter().map(|(id, _)| *id));
                let mut total = 0;
                for (_, r) in all {
                    total += r.map_err(aio_to_py)?;
                }
                Ok(total)
            }
        }
    }

    /// Reads into `buffer` and waits; bytes read.
    #[pyo3(signature = (buffer, path, offset=0))]
    fn sync_pread(
        &self,
        py: Python<'_>,
        buffer: &Bound<'_, PyAny>,
        path: PathBuf,
        offset: u64,
    ) -> PyResult<usize> {
        self.run_sync(py, Op::Read, buffer, path, offset)
    }

    /// Writes `buffer`, waits, and returns once the data is durable (`fdatasync`).
    #[pyo3(signature = (buffer, path, offset=0))]
    fn sync_pwrite(
        &self,
        py: Python<'_>,
        buffer: &Bound<'_, PyAny>,
        path: PathBuf,
        offset: u64,
    ) -> PyResult<usize> {
        self.run_sync(py, Op::Write, buffer, path, offset)
    }

    /// Requests submitted and not yet waited on.
    fn pending(&self) -> usize {
        self.held
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// Counters: requests, bytes, direct, direct_refused, bounced, last_direct_refused.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.engine.stats();
        let d = PyDict::new(py);
        d.set_item("requests", s.requests)?;
        d.set_item("bytes", s.bytes)?;
        d.set_item("direct", s.direct)?;
        d.set_item("direct_refused", s.direct_refused)?;
        d.set_item("bounced", s.bounced)?;
        d.set_item("last_direct_refused", s.last_direct_refused)?;
        Ok(d)
    }

    /// `io_uring` or `threads`.
    #[getter]
    fn backend(&self) -> &'static str {
        self.engine.backend().name()
    }

    /// `requested`, or what `auto` found (e.g. why io_uring_setup failed).
    #[getter]
    fn backend_reason(&self) -> String {
        self.engine.backend_reason().to_string()
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.engine.config().block_size
    }

    #[getter]
    fn queue_depth(&self) -> usize {
        self.engine.config().queue_depth
    }

    #[getter]
    fn intra_op_parallelism(&self) -> usize {
        self.engine.config().intra_op_parallelism
    }

    #[getter]
    fn single_submit(&self) -> bool {
        self.engine.config().single_submit
    }

    #[getter]
    fn overlap_events(&self) -> bool {
        self.engine.config().overlap_events
    }
}
