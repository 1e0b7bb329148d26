//! The seam between Rust and the CUDA C++ of `cuda/`: one `cxx` bridge.
//!
//! The shared structs below are the only definition of what crosses it: Rust fills them
//! (`super::cuda`), and the C++ launchers of `cuda/host/` take them as they are. A fused
//! epilogue crosses as its name and its operands by position ([`Fusion`]): nothing here
//! names one. The enums are defined in C++ (`DType`, `Form`: `cuda/device/types.h`, which the kernels
//! include too; `RowsOp`: `cuda/device/rows.h`, which only the row kernels include); cxx
//! checks at compile time that the variants here match.
//!
//! Operands arrive normalised: Rust has already decided row- or column-major, the
//! leading dimension, and copied whatever no kernel can read in place (negative strides,
//! an expanded batch, no unit stride). C++ decides only what Rust cannot know: the
//! device's capability and so the kernels, the 16-byte alignment routing, the workspace
//! size, and the launch. Every C++ failure comes back once, as `Err(cxx::Exception)`
//! whose message names the failed call.
//!
//! The functions are compiled only with CUDA (`cfg(groupmm_cuda)`); the structs always,
//! so the normalisation in Rust is built and tested everywhere.

#[cxx::bridge(namespace = "gmm")]
pub(crate) mod bridge {
    /// Element types; C++: `gmm::DType` in cuda/device/types.h.
    #[repr(u8)]
    #[derive(Debug)]
    enum DType {
        F16 = 0,
        BF16 = 1,
        F32 = 2,
        F64 = 3,
    }

    /// The packed forms of `crate::shape::Form`; C++: `gmm::Form` in cuda/device/types.h.
    #[repr(u8)]
    #[derive(Debug)]
    enum Form {
        GroupedM = 0,
        GroupedK = 1,
        GroupedN = 2,
        Batched = 3,
    }

    /// A normalised 2- or 3-D device operand (strides in elements). Element `(g, r, c)`
    /// is at `ptr + g * batch_stride + r * ld + c` (row-major) or
    /// `ptr + g * batch_stride + r + c * ld` (`col_major`). 2-D operands have `batch` 1
    /// and `batch_stride` 0; an operand without elements is row-major.
    #[derive(Clone, Copy, Debug)]
    struct Operand {
        /// Device address of element `(0, 0, 0)`.
        ptr: u64,
        /// Extent of the batch (group) dimension; 1 for 2-D operands.
        batch: i64,
        /// Extent of the second-to-last dimension.
        rows: i64,
        /// Extent of the last dimension.
        cols: i64,
        /// Distance between batches (>= 1 when `batch` > 1 and the operand has elements).
        batch_stride: i64,
        /// Leading dimension: the stride of the non-unit-stride dimension, rounded up to
        /// a multiple of 8 when that dimension has extent <= 1 (never used, never
        /// spoils the alignment).
        ld: i64,
        /// Unit stride along the rows (the columns are `ld` apart).
        col_major: bool,
    }

    /// One packed product (forms in `crate::shape`). `m`, `n`, `k`, `groups` are those
    /// of the validated product (`crate::shape::PackedDims`): GroupedM m = T, GroupedK k = T, GroupedN
    /// n = N_total. The output `c` is row-major and need not be initialised.
    #[derive(Clone, Copy, Debug)]
    struct PackedRequest<'a> {
        form: Form,
        dtype: DType,
        out_dtype: DType,
        /// CUDA device index of every operand.
        device: i32,
        /// float32 only: TF32 tensor cores allowed.
        allow_tf32: bool,
        groups: i64,
        m: i64,
        n: i64,
        k: i64,
        a: Operand,
        b: Operand,
        c: Operand,
        /// Device address of the contiguous int32 `offs[groups]`; 0 for Batched.
        offs: u64,
        /// What the product does beyond `c = a · b` (see [`Fusion`]).
        fusion: Fusion<'a>,
        /// The deferred error flag was taken by this call's first request (this one runs
        /// on rows the call gathered itself): not taken again, so that an index error of
        /// that gather is reported at the next call, as every other one is.
        flag_taken: bool,
        /// The `cudaStream_t` to run on.
        stream: u64,
    }

    /// The parts of a packed product beyond `c = a · b` that a kernel may or may not do
    /// (Hopper's varlen kernels do some, the other kernels none). Each is one field here;
    /// where no kernel for the device, dtype and layout does what is asked,
    /// [`submit_packed`] answers [`Submitted::Unsupported`] before any device work and the
    /// engine composes the same product from plain parts. All zero: a plain product.
    #[derive(Clone, Copy, Debug)]
    struct Fusion<'a> {
        /// GroupedM and GroupedK, else 0: device address of a contiguous int32 routed-row
        /// index; an index outside the source rows reads a row of zeros and raises the
        /// device's deferred error flag (reported at the next call).
        /// - GroupedM: `src` is `[m]`; row `r` of the product's A is row `src[r]` of `a`
        ///   (whose `rows` may differ from `m`).
        /// - GroupedK: the product is `c[g] = A_gᵀ·B_g` over the `k = R` routed rows of
        ///   group `g` (`offs` over the `R` rows; `src` is `[k]`). Without `src_b`, routed
        ///   row `r` of A is row `src[r]` of the tensor `a` describes: `a` is then `xᵀ`, a
        ///   column-major `[m, a.cols]` view of a row-major `x [a.cols, m]`, whose `cols`
        ///   is the number of source rows, not `k`; `b` is `[k, n]` as in a plain product.
        ///   With `src_b`, see there.
        src: u64,
        /// GroupedK only (GroupedM: false): `src` indexes the token rows of `b` instead of
        /// those of `a`: routed row `r` of B is row `src[r]` of `b` (`b` row-major
        /// `[b.rows, n]`, its `rows` the number of source rows, not `k`); `a` is the
        /// `[m, k]` operand of a plain product.
        src_b: bool,
        /// The epilogue, by name: that of its rule (`crate::shape::EPILOGUES`, where its
        /// operands and what it computes are listed) and of its C++ policy (`kEpi`,
        /// cuda/kernels/varlen/epilogue/<name>.h); empty: `c = a · b`. GroupedM only; rows
        /// past the last group end get zeros in every output.
        epilogue: &'a str,
        /// The epilogue's operands by position, in the order of its rule's list (its inputs,
        /// then its outputs beyond `c`): device addresses, contiguous but where the rule says
        /// otherwise, 0 for an absent one and past the list.
        operands: [u64; 6],
    }

    /// One list product; its groups travel as a slice of [`ListGroup`].
    #[derive(Clone, Copy, Debug)]
    struct ListRequest {
        dtype: DType,
        out_dtype: DType,
        device: i32,
        allow_tf32: bool,
        stream: u64,
    }

    /// Group `i` of a list product: `c = a · b` with `a` `[m, k]`, `b` `[k, n]` and
    /// `c` `[m, n]` row-major (extents in the operands).
    #[derive(Clone, Copy, Debug)]
    struct ListGroup {
        a: Operand,
        b: Operand,
        c: Operand,
    }

    /// The row ops of `crate::shape::RowsOp`; C++: `gmm::RowsOp` in cuda/device/rows.h
    /// (what each computes there).
    #[repr(u8)]
    #[derive(Debug)]
    enum RowsOp {
        /// `out[r, c] = silu(x[r, c]) * x[r, F + c]`.
        Swiglu = 0,
        /// The gradient of `Swiglu` w.r.t. its input `y`, from the output gradient `x`.
        SwigluBackward = 1,
        /// `out[t] = sum_j w[t, j] * x[inverse[t, j]]`.
        GatherSum = 2,
        /// `out[inverse[t, j]] = w[t, j] * x[t]`, every row written (zeros where unnamed).
        ScatterRows = 3,
        /// `out[t, j] = <x[t], y[inverse[t, j]]>`.
        RowDots = 4,
        /// `out[t, j]` (int64): the column of the `j`-th best of the `k` largest values
        /// of `x[t]` (`crate::shape::topk_before`'s order); `tokens` rows, `cols` columns
        /// (at most `crate::shape::TOPK_CUDA_MAX_COLS`), `top_k` = k.
        TopK = 5,
    }

    /// One row op, validated by Rust (`crate::shape`'s row rules, applied by
    /// `crate::exec::rows`): every operand contiguous on `device`; addresses of absent
    /// operands 0. TopK: `x` the scores `[tokens, cols]`, `out` int64 `[tokens, top_k]`.
    #[derive(Clone, Copy, Debug)]
    struct RowsRequest {
        op: RowsOp,
        /// Of `x`, `y` and (but RowDots) `out`.
        dtype: DType,
        /// Of `weights` and of RowDots' `out`: `dtype` or F32.
        w_dtype: DType,
        device: i32,
        /// Rows of `inverse` (`T`) and its columns (`k`).
        tokens: i64,
        top_k: i64,
        /// Rows `R` of the expert-ordered operand.
        rows: i64,
        /// Columns: `F` for the SwiGLU ops (their `[R, 2F]` operands have twice as
        /// many), `D` for the others.
        cols: i64,
        x: u64,
        y: u64,
        /// int32 `[tokens, top_k]`: the row of the expert-ordered operand of each choice.
        inverse: u64,
        weights: u64,
        out: u64,
        /// ScatterRows: zeroed int32 `[rows]` device memory (the inverse permutation).
        scratch: u64,
        stream: u64,
    }

    /// What [`submit_packed`] did.
    #[cfg(groupmm_cuda)]
    #[repr(u8)]
    #[derive(Debug)]
    enum Submitted {
        /// The product is enqueued on the stream.
        Launched = 0,
        /// Nothing was enqueued: the workspace given was too small, or the stream is
        /// capturing a graph (`capturing`). Launch `plan` with `workspace_bytes`.
        NeedWorkspace = 1,
        /// Nothing was enqueued: an earlier call on the device met invalid `offs`.
        OffsPending = 2,
        /// Nothing was enqueued: no kernel for this device, dtype and layout does what the
        /// request's `fusion` asks (or a development build's `GROUPMM_SM90_*` override
        /// turned it off).
        /// Compose it from plain products and row ops.
        Unsupported = 3,
        /// Nothing was enqueued: an earlier call on the device met a routed-row index
        /// (`Fusion::src`, a row op's `inverse`) out of range.
        IndexPending = 4,
    }

    /// The answer of [`submit_packed`].
    #[cfg(groupmm_cuda)]
    struct PackedSubmit {
        status: Submitted,
        /// NeedWorkspace: the bytes the launch needs (256-byte aligned memory).
        workspace_bytes: usize,
        /// NeedWorkspace: the stream is capturing a CUDA graph, so the workspace must
        /// be fresh memory of the graph, not a block that outlives it.
        capturing: bool,
        /// NeedWorkspace: the plan, for [`launch_planned`]; null otherwise.
        plan: UniquePtr<PackedPlan>,
    }

    /// The answer of [`plan_list`].
    #[cfg(groupmm_cuda)]
    struct ListPlanned {
        /// Nothing was planned: an earlier call on the device met invalid `offs`.
        offs_pending: bool,
        /// Nothing was planned: an earlier call on the device met a routed-row index out
        /// of range.
        index_pending: bool,
        /// Size of the per-group argument block ([`write_list_args`]).
        args_bytes: usize,
        /// Workspace bytes [`launch_list`] needs.
        workspace_bytes: usize,
        /// The plan; null when `offs_pending`.
        plan: UniquePtr<ListPlan>,
    }

    #[cfg(groupmm_cuda)]
    unsafe extern "C++" {
        include!("host/bridge.h");
        include!("device/rows.h");

        type DType;
        type Form;
        type RowsOp;
        /// A planned packed launch (cuda/host/plan.h).
        type PackedPlan;
        /// A planned list launch (cuda/host/plan.h).
        type ListPlan;

        /// Reads and clears the device's deferred error flag, plans the launch once and,
        /// when the stream is not capturing and `workspace` (256-byte aligned device
        /// memory, or 0) holds enough bytes, launches at once. Never syncs.
        ///
        /// # Safety
        /// The operands describe live device memory of the request's device, used on
        /// `r.stream`; `workspace` holds `workspace_bytes` bytes there.
        unsafe fn submit_packed(
            r: &PackedRequest,
            workspace: u64,
            workspace_bytes: usize,
        ) -> Result<PackedSubmit>;

        /// Launches a plan that [`submit_packed`] kept, without planning again.
        ///
        /// # Safety
        /// As for `submit_packed`, for the request the plan was made from.
        unsafe fn launch_planned(
            plan: &PackedPlan,
            workspace: u64,
            workspace_bytes: usize,
        ) -> Result<()>;

        /// Reads and clears the deferred error flag and plans a list launch (host only).
        fn plan_list(r: &ListRequest, groups: &[ListGroup]) -> Result<ListPlanned>;

        /// Writes the plan's per-group argument block into `host` (host only).
        fn write_list_args(plan: &ListPlan, host: &mut [u8]) -> Result<()>;

        /// Launches a planned list product; `device_args` holds the block that
        /// [`write_list_args`] wrote, copied there on the request's stream.
        ///
        /// # Safety
        /// As for `submit_packed`; `device_args` (256-byte aligned) and `workspace`
        /// live on the device until the work completes.
        unsafe fn launch_list(
            plan: &ListPlan,
            device_args: u64,
            workspace: u64,
            workspace_bytes: usize,
        ) -> Result<()>;

        /// Enqueues one row op of the MoE glue on `r.stream`.
        ///
        /// # Safety
        /// The addresses are of live device memory of `r.device` that holds the shapes
        /// the request names, used on `r.stream`.
        unsafe fn launch_rows(r: &RowsRequest) -> Result<()>;

        /// Whether products of `dtype` on `device` read routed rows through an index
        /// inside the GEMM (the sm_90 kernels; a development build's `GROUPMM_SM90_GATHER=0`
        /// turns it off).
        fn gathers_in_gemm(device: i32, dtype: DType) -> Result<bool>;

        /// Reads and clears the device's deferred error flag (no sync).
        fn take_deferred_error(device: i32) -> Result<bool>;

        /// The most SMs a launch of this process may occupy (0: all).
        fn set_sm_limit(sms: i32) -> Result<()>;

        /// The limit `set_sm_limit` set (0: none).
        fn sm_limit() -> i32;
    }
}

pub(crate) use bridge::*;
