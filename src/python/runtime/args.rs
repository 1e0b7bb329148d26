//! The call's arguments read into the engine's descriptions: the reference argument
//! (`a`, `As[0]`: the kind, device and dtype outputs are made like), inputs of its kind,
//! `offs`, indices of any integer dtype, and a caller's `out`.

use super::PyRuntime;
use crate::error::{Error, Result};
use crate::exec::{IntTensor, Output, Tensor};
use crate::python::tensor::{self, Arg, Kind, Want};
use pyo3::intern;
use pyo3::prelude::*;
use std::fmt::Display;

impl<'py> PyRuntime<'py> {
    /// Every array argument is of the kind of the reference argument.
    fn check_kind(&self, name: &dyn Display, kind: Kind) -> Result<()> {
        match &self.like {
            Some((like, k, _)) if *k != kind => Err(Error::Type(format!(
                "{name}: expected a {} like {like}, found a {}",
                k.name(),
                kind.name()
            ))),
            _ => Ok(()),
        }
    }

    fn tensor(&mut self, name: &dyn Display, obj: &Bound<'py, PyAny>) -> PyResult<(Tensor, Kind)> {
        let Arg {
            obj,
            kind,
            ptr,
            layout,
            dtype,
            device,
            ..
        } = tensor::read(self.py, name, obj, Want::Float)?;
        let id = self.register(obj);
        let t = Tensor {
            ptr,
            dtype: dtype.expect("a float argument"),
            layout,
            device,
            id,
            transposed: false,
        };
        Ok((t, kind))
    }

    /// Reads the reference argument of the call (`a`, `As[0]`).
    pub fn reference(&mut self, name: &'static str, obj: &Bound<'py, PyAny>) -> PyResult<Tensor> {
        let (t, kind) = self.tensor(&name, obj)?;
        self.like = Some((name, kind, self.objs[t.id].clone()));
        self.like_dtype = Some(t.dtype);
        Ok(t)
    }

    /// Reads an input array of the kind of the reference argument.
    pub fn input(&mut self, name: &dyn Display, obj: &Bound<'py, PyAny>) -> PyResult<Tensor> {
        let (t, kind) = self.tensor(name, obj)?;
        self.check_kind(name, kind)?;
        Ok(t)
    }

    /// Reads `offs` (int32), if given.
    pub fn offs(&mut self, obj: Option<&Bound<'py, PyAny>>) -> PyResult<Option<IntTensor>> {
        match obj.filter(|o| !o.is_none()) {
            Some(o) => self.int_arg("offs", o, Want::Int32).map(Some),
            None => Ok(None),
        }
    }

    /// Reads an index argument named `name` (`src`, `inverse`): any integer dtype, which
    /// the engine has converted to int32 (through [`Runtime::int32`]) unless it is.
    pub fn index(&mut self, name: &'static str, obj: &Bound<'py, PyAny>) -> PyResult<IntTensor> {
        self.int_arg(name, obj, Want::Index)
    }

    fn int_arg(
        &mut self,
        name: &'static str,
        obj: &Bound<'py, PyAny>,
        want: Want,
    ) -> PyResult<IntTensor> {
        let a = tensor::read(self.py, &name, obj, want)?;
        self.check_kind(&name, a.kind)?;
        let (ptr, layout, device, int32) = (a.ptr, a.layout, a.device, a.int32);
        let id = self.register(a.obj);
        Ok(IntTensor {
            ptr,
            layout,
            device,
            id,
            int32,
        })
    }

    /// Reads a user-supplied output (`out=`): an array of the call's kind that can be
    /// written.
    pub fn output(
        &mut self,
        name: &dyn Display,
        obj: &Bound<'py, PyAny>,
    ) -> PyResult<Output<Bound<'py, PyAny>>> {
        let a = tensor::read(self.py, name, obj, Want::Float)?;
        let like = self.kind();
        if a.kind != like {
            return Err(Error::Type(format!(
                "{name}: expected a {} like the inputs, found a {}",
                like.name(),
                a.kind.name()
            ))
            .into());
        }
        if a.kind == Kind::Numpy {
            let writeable = obj
                .getattr(intern!(self.py, "flags"))
                .and_then(|f| f.getattr(intern!(self.py, "writeable")))
                .and_then(|w| w.extract::<bool>())
                .unwrap_or(true);
            if !writeable {
                return Err(Error::Value(format!(
                    "{name}: the numpy array is read-only (flags.writeable is False)"
                ))
                .into());
            }
            if !a.obj.is(obj) {
                return Err(Error::Value(format!(
                    "{name}: the numpy array is not aligned to its element size"
                ))
                .into());
            }
        }
        let t = Tensor {
            ptr: a.ptr,
            dtype: a.dtype.expect("a float argument"),
            layout: a.layout,
            device: a.device,
            id: usize::MAX,
            transposed: false,
        };
        Ok((a.obj, t))
    }
}
