//! What a fused epilogue is to the Rust side: the shape of its rule entry
//! ([`EpilogueRule`]: its name, operand list, outputs and shape rule; the entries
//! themselves: [`EPILOGUES`](super::EPILOGUES)) and the epilogue of one request
//! ([`Epilogue`]: a rule and its operands by position), generic over how an operand is
//! described (a layout for the rules, a tensor in the engine's request, `()` for the kind
//! alone). The engine, the bridge and the Python face read epilogues through these alone:
//! none of them names one.

use super::PackedDims;
use crate::error::Result;
use crate::layout::Layout;
use std::fmt;
use std::hash::{Hash, Hasher};

/// The most input operands an epilogue's rule lists.
pub const MAX_OPERANDS: usize = 4;

/// How an epilogue operand agrees with the product's first operand.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OperandKind {
    /// The first operand's dtype and device, made contiguous.
    Like,
    /// float32 on the first operand's device, made contiguous; what it is, for messages.
    F32(&'static str),
    /// A second weight (at most one per rule): the first operand's dtype and device, read
    /// in place with `b`'s strides (where its strides differ from `b`'s, no kernel runs:
    /// the caller composes).
    Weight,
}

/// One input operand of an epilogue, in the order of its rule's list.
#[derive(Debug, Clone, Copy)]
pub struct OperandRule {
    /// Its name in messages and in the Python face.
    pub name: &'static str,
    /// It may be absent (`None`).
    pub optional: bool,
    /// How it agrees with the first operand.
    pub kind: OperandKind,
    /// `out` may be this operand itself (each tile reads its part before writing the same
    /// part), else it must not overlap it.
    pub out_may_be: bool,
}

/// One output of an epilogue, in the order the op returns them.
#[derive(Debug, Clone, Copy)]
pub struct OutputRule {
    /// Its name in messages.
    pub name: &'static str,
    /// Its shape from `R` (the routed rows) and `F` (the rule's column count).
    pub shape: fn(usize, usize) -> [usize; 2],
    /// float32 (else the product's output dtype).
    pub f32: bool,
}

/// The layouts an epilogue's shape rule reads.
#[derive(Debug, Clone, Copy)]
pub struct EpilogueShapes<'a> {
    /// The first operand (`x`, `dy`).
    pub a: &'a Layout,
    /// The weights.
    pub b: &'a Layout,
    /// The rule's operands by position (`None`: absent).
    pub operands: &'a [Option<&'a Layout>],
    /// The routed-row index; absent: the rows of `a` in order.
    pub src: Option<&'a Layout>,
    /// The length of `offs`.
    pub offs_len: usize,
}

/// One fused epilogue of a GroupedM product: everything the Rust side knows of it.
pub struct EpilogueRule {
    /// Its name: the Python face's (`_native.product`), the bridge's and the C++ policy's
    /// (`kEpi`, cuda/kernels/varlen/epilogue/<name>.h).
    pub name: &'static str,
    /// The name of the product's first operand in messages (`x`, `dy`).
    pub a: &'static str,
    /// The product is `a · bᵀ` (`b` read transposed, in place).
    pub b_transposed: bool,
    /// Its input operands, in order (the Python face's `operands`, the bridge's first
    /// positions).
    pub operands: &'static [OperandRule],
    /// Every output in the order the op returns them, the first written where a plain
    /// product's output is (`c`), the rest after the inputs in the bridge's positions;
    /// empty: the one output is the product's shape.
    pub outputs: &'static [OutputRule],
    /// Its shape rule: the product that runs and `F` (0 where it has none).
    pub plan: fn(&EpilogueShapes<'_>) -> Result<(PackedDims, usize)>,
}

impl fmt::Debug for EpilogueRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name)
    }
}

impl PartialEq for EpilogueRule {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name
    }
}

impl Eq for EpilogueRule {}

impl Hash for EpilogueRule {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.name.hash(state);
    }
}

/// What a product does beyond `c = a · b`: a rule of [`EPILOGUES`](super::EPILOGUES) with
/// its operands by position (`T` describes an operand: a [`Layout`] for the rules, the
/// engine's tensor in its request, `()` for the kind alone), or nothing (`rule` `None`,
/// the default: `c = p`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Epilogue<T> {
    /// The rule; `None`: a plain product.
    pub rule: Option<&'static EpilogueRule>,
    /// Its operands in the order of `rule.operands` (`None`: absent, and past the list).
    pub operands: [Option<T>; MAX_OPERANDS],
}

impl<T> Default for Epilogue<T> {
    fn default() -> Self {
        Epilogue {
            rule: None,
            operands: std::array::from_fn(|_| None),
        }
    }
}

impl<T> Epilogue<T> {
    /// No epilogue: `c = p`.
    pub fn plain() -> Self {
        Self::default()
    }

    /// `rule` with `operands` by position (the rule's list; shorter: the rest absent).
    pub fn new(rule: &'static EpilogueRule, operands: impl IntoIterator<Item = Option<T>>) -> Self {
        let mut e = Epilogue {
            rule: Some(rule),
            ..Self::default()
        };
        for (slot, o) in e.operands.iter_mut().zip(operands) {
            *slot = o;
        }
        e
    }

    /// A plain product.
    pub fn is_plain(&self) -> bool {
        self.rule.is_none()
    }

    /// The name of the product's first operand in messages.
    pub fn a_name(&self) -> &'static str {
        self.rule.map_or("x", |r| r.a)
    }

    /// The operands present, each with its entry of the rule's list, in order.
    pub fn listed(&self) -> impl Iterator<Item = (&'static OperandRule, &T)> {
        let rules: &'static [OperandRule] = self.rule.map_or(&[], |r| r.operands);
        rules
            .iter()
            .zip(&self.operands)
            .filter_map(|(r, o)| o.as_ref().map(|o| (r, o)))
    }

    /// The same epilogue with each operand mapped by `f`.
    pub fn map<U>(self, mut f: impl FnMut(T) -> U) -> Epilogue<U> {
        Epilogue {
            rule: self.rule,
            operands: self.operands.map(|o| o.map(&mut f)),
        }
    }

    /// The same epilogue with each operand mapped by `f`, which may fail (in order).
    pub fn try_map<U, E>(self, mut f: impl FnMut(T) -> Result<U, E>) -> Result<Epilogue<U>, E> {
        let mut out = Epilogue {
            rule: self.rule,
            ..Epilogue::default()
        };
        for (slot, o) in out.operands.iter_mut().zip(self.operands) {
            *slot = o.map(&mut f).transpose()?;
        }
        Ok(out)
    }

    /// The same epilogue with its operands borrowed.
    pub fn as_ref(&self) -> Epilogue<&T> {
        Epilogue {
            rule: self.rule,
            operands: std::array::from_fn(|i| self.operands[i].as_ref()),
        }
    }

    /// The kind alone.
    pub fn kind(&self) -> Epilogue<()> {
        self.as_ref().map(|_| ())
    }
}
