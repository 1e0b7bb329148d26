//! The engine's vocabulary: what a face describes ([`Tensor`], [`IntTensor`], [`Device`])
//! and what it lends ([`Runtime`]). Every part of the engine speaks it; it imports
//! nothing of the engine.

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layout::{Layout, Transposable};
use std::fmt;

/// Where an operand lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    /// Host memory.
    Cpu,
    /// Memory of the CUDA device with this index.
    Cuda(i32),
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

/// A float operand as the engine sees it.
#[derive(Debug, Clone)]
pub struct Tensor {
    /// Address of element `[0, 0, ...]` (a device address on CUDA).
    pub ptr: usize,
    /// Element type.
    pub dtype: DType,
    /// Shape and strides in elements.
    pub layout: Layout,
    /// Where the memory is.
    pub device: Device,
    /// The face's handle for the object behind this description, handed back in
    /// [`Runtime::contiguous`].
    pub id: usize,
    /// True when `layout` is the object's own layout with the last two dims swapped.
    pub transposed: bool,
}

impl AsRef<Layout> for Tensor {
    fn as_ref(&self) -> &Layout {
        &self.layout
    }
}

impl Transposable for Tensor {
    fn transposed(&self) -> Self {
        Tensor {
            layout: self.layout.transposed(),
            transposed: !self.transposed,
            ..self.clone()
        }
    }
}

impl Tensor {
    /// Half-open byte range the elements occupy (empty for empty tensors).
    pub fn byte_range(&self) -> (usize, usize) {
        if self.layout.numel() == 0 {
            return (self.ptr, self.ptr);
        }
        let es = self.dtype.size() as isize;
        let (lo, hi) = self.layout.offset_range();
        (
            (self.ptr as isize + lo * es) as usize,
            (self.ptr as isize + (hi + 1) * es) as usize,
        )
    }

    pub(super) fn like(&self) -> (Option<DType>, Device) {
        (Some(self.dtype), self.device)
    }

    pub(super) fn reference(&self) -> (DType, Device) {
        (self.dtype, self.device)
    }
}

/// An integer operand: `offs` (int32 group ends), or an index (`src`, `inverse`). The
/// kernels read int32 only: a face may describe an index of another integer dtype
/// (`int32: false`), which the engine has converted through [`Runtime::int32`] first.
#[derive(Debug, Clone)]
pub struct IntTensor {
    /// Address of element `[0, ...]`.
    pub ptr: usize,
    /// Its layout (checked by the rules).
    pub layout: Layout,
    /// Where the memory is.
    pub device: Device,
    /// The face's handle, as for [`Tensor::id`].
    pub id: usize,
    /// True when the elements are int32 (always for `offs`).
    pub int32: bool,
}

/// An output: the face's own object and its description.
pub type Output<O> = (O, Tensor);

/// The gradients of a backward call, `(dA, dB)`, each `None` unless asked for.
pub type Grads<O> = (Option<O>, Option<O>);

/// What a face's runtime lends the engine for one call: memory (outputs, workspaces,
/// argument blocks, normalised copies), the current CUDA stream, the TF32 flag, and how
/// CPU kernels run (the torch face releases the GIL). Only [`Runtime::alloc`] is needed
/// by the GEMMs on the CPU; the other methods serve CUDA calls and the row ops (TopK's
/// int64 output: [`Runtime::alloc_int64`]), and fail by default.
pub trait Runtime {
    /// The face's output object (a torch tensor, a numpy array, an ndarray array).
    type Out;

    /// A fresh row-major contiguous output (contents need not be initialised).
    fn alloc(&mut self, shape: &[usize], dtype: DType, device: Device)
        -> Result<Output<Self::Out>>;

    /// A fresh row-major contiguous int64 output (an index the engine writes: the router's
    /// top-k ids): the face's object and its address. Only the faces that run TopK lend it.
    fn alloc_int64(&mut self, _shape: &[usize], _device: Device) -> Result<(Self::Out, usize)> {
        Err(Error::Type(
            "internal: this face lends no int64 outputs".into(),
        ))
    }

    /// Runs CPU kernels (the torch face releases the GIL here).
    fn run_cpu(&mut self, job: &mut (dyn FnMut() + Send)) {
        job()
    }

    /// A contiguous copy of the face's object `id` (CUDA operands no kernel reads in
    /// place; any operand of a row op): its address and layout, in the object's own
    /// orientation. It must stay alive until the call returns.
    fn contiguous(&mut self, _id: usize) -> Result<(usize, Layout)> {
        Err(no_cuda_memory())
    }

    /// A contiguous int32 copy of the face's integer object `id` (an index of another
    /// integer dtype): its address (its layout: row-major, the object's shape). It must
    /// stay alive until the call returns.
    fn int32(&mut self, _id: usize) -> Result<usize> {
        Err(no_cuda_memory())
    }

    /// Whether [`Runtime::transposed`] works: then a packed backward gives each gradient
    /// in its operand's layout (`shape::transposed_grads`).
    fn can_transpose(&self) -> bool {
        false
    }

    /// The output `o` with its last two dimensions swapped (a view, no copy).
    fn transposed(&mut self, _o: Self::Out) -> Result<Self::Out> {
        Err(Error::Type(
            "internal: this face cannot transpose an output".into(),
        ))
    }

    /// Copies `src` into `dst` on the device, stream-ordered (CUDA outputs that the
    /// kernels cannot write in place).
    fn copy_into(&mut self, _dst: &Self::Out, _src: &Self::Out) -> Result<()> {
        Err(no_cuda_memory())
    }

    /// The current CUDA stream (`cudaStream_t`) of `device`.
    fn stream(&mut self, _device: i32) -> Result<u64> {
        Err(no_cuda_memory())
    }

    /// Whether float32 products may use TF32 tensor cores.
    fn allow_tf32(&mut self) -> Result<bool> {
        Ok(false)
    }

    /// The workspace kept for (`device`, `stream`): `(address, bytes)`, `(0, 0)` if none.
    /// It must stay alive until the call returns.
    fn cached_workspace(&mut self, _device: i32, _stream: u64) -> (u64, usize) {
        (0, 0)
    }

    /// A workspace of at least `bytes` (256-byte aligned) for a launch on `stream`;
    /// under graph capture (`capturing`) fresh memory of the graph, never a kept block.
    /// Zero-filled when allocated (stream-ordered): the CUTLASS ptr-array kernels' tensor
    /// maps live there, and the first copy into each is seen as a read of never-written
    /// memory by compute-sanitizer's initcheck (cuda/NOTES.md, "compute-sanitizer initcheck").
    fn workspace(
        &mut self,
        _device: i32,
        _stream: u64,
        _bytes: usize,
        _capturing: bool,
    ) -> Result<u64> {
        Err(no_cuda_memory())
    }

    /// Fresh, zero-filled device memory of `bytes` (256-byte aligned), stream-ordered (a
    /// kernel workspace; see `workspace`).
    fn device_bytes(&mut self, _device: i32, _bytes: usize) -> Result<u64> {
        Err(no_cuda_memory())
    }

    /// Device memory of `bytes` holding what `fill` writes into a host buffer of that
    /// size, copied on the current stream (no sync).
    fn upload(
        &mut self,
        _device: i32,
        _bytes: usize,
        _fill: &mut dyn FnMut(&mut [u8]) -> Result<()>,
    ) -> Result<u64> {
        Err(no_cuda_memory())
    }
}

fn no_cuda_memory() -> Error {
    Error::Cuda("internal: this face lends no CUDA memory".into())
}

/// `t`, or a contiguous copy of it (made by the face): the row ops read contiguous rows.
pub(super) fn contiguous<R: Runtime>(rt: &mut R, t: &Tensor) -> Result<Tensor> {
    if t.layout.is_contiguous() {
        return Ok(t.clone());
    }
    let (ptr, layout) = rt.contiguous(t.id)?;
    Ok(Tensor {
        ptr,
        layout,
        transposed: false,
        ..t.clone()
    })
}

/// An index as the kernels read it: `i` when it is contiguous int32, else a contiguous
/// int32 copy made by the face (one conversion for any other integer dtype).
pub(super) fn contiguous_int32<R: Runtime>(rt: &mut R, i: &IntTensor) -> Result<IntTensor> {
    let (ptr, layout) = match (i.int32, i.layout.is_contiguous()) {
        (true, true) => return Ok(i.clone()),
        (true, false) => rt.contiguous(i.id)?,
        (false, _) => (rt.int32(i.id)?, Layout::contiguous(&i.layout.shape)),
    };
    Ok(IntTensor {
        ptr,
        layout,
        int32: true,
        ..i.clone()
    })
}
