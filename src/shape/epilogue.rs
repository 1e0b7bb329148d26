//! The one epilogue type of the Rust side: what a product of the MoE layer does beyond
//! `c = a · b` ([`Epilogue`]), generic over how an operand is described (a layout for the
//! rules, a tensor in the engine's request, `()` for the kind alone). What each computes,
//! element by element: the bridge's `Fusion` (src/exec/ffi.rs), which the engine maps it
//! to in one place.

use std::convert::Infallible;

/// What a product does beyond `c = a · b`, with the operands it reads: `T` describes an
/// operand (a [`Layout`](crate::layout::Layout) for the rules, the engine's tensor in its request; `()` for the
/// kind alone). The one epilogue type of the Rust side; the engine maps it to the bridge's
/// in one place.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum Epilogue<T> {
    /// `c = p`.
    #[default]
    Plain,
    /// The up projection and its activation: `pre = p`, `act = silu(gate) * up`. The
    /// weights are `b`'s columns `[gate | up]`, or with `up`, `b` the gate's and `up` the
    /// up projection's, of `b`'s shape each (`p = a · [b | up]`, never concatenated).
    SwiGLU {
        /// `[G, K, F]`, the up projection's weights (absent: `b`'s columns `[F, 2F)`).
        up: Option<T>,
    },
    /// The backward of the down projection through the router weight and the SwiGLU.
    DGated {
        /// `[R, 2F]`, the saved pre-activation.
        pre: T,
        /// float32 `[R]`, the router weight of each row.
        scale: T,
    },
    /// Each row of the product times its scale: `c[r] = scale[r] * p[r]`.
    RowScale {
        /// float32 `[R]`, the scale of each row.
        scale: T,
    },
}

impl<T> Epilogue<T> {
    /// The same epilogue with each operand mapped by `f`.
    pub fn map<U>(self, mut f: impl FnMut(T) -> U) -> Epilogue<U> {
        match self.try_map(|t| Ok::<U, Infallible>(f(t))) {
            Ok(e) => e,
            Err(never) => match never {},
        }
    }

    /// The same epilogue with each operand mapped by `f`, which may fail (the operands in
    /// order: `up`; `pre`, then `scale`).
    pub fn try_map<U, E>(self, mut f: impl FnMut(T) -> Result<U, E>) -> Result<Epilogue<U>, E> {
        Ok(match self {
            Epilogue::Plain => Epilogue::Plain,
            Epilogue::SwiGLU { up } => Epilogue::SwiGLU {
                up: up.map(&mut f).transpose()?,
            },
            Epilogue::DGated { pre, scale } => Epilogue::DGated {
                pre: f(pre)?,
                scale: f(scale)?,
            },
            Epilogue::RowScale { scale } => Epilogue::RowScale { scale: f(scale)? },
        })
    }

    /// The same epilogue with its operands borrowed.
    pub fn as_ref(&self) -> Epilogue<&T> {
        match self {
            Epilogue::Plain => Epilogue::Plain,
            Epilogue::SwiGLU { up } => Epilogue::SwiGLU { up: up.as_ref() },
            Epilogue::DGated { pre, scale } => Epilogue::DGated { pre, scale },
            Epilogue::RowScale { scale } => Epilogue::RowScale { scale },
        }
    }

    /// The kind alone.
    pub fn kind(&self) -> Epilogue<()> {
        self.as_ref().map(|_| ())
    }
}
