//! Host-side pieces every back-end shares: inputs from a seed, the f64 reference, checks.

use ksearch_core::data::{self, Check};
use ksearch_core::protocol::{Failure, FailureClass, WorkloadReq};
use ksearch_core::reference::{self, RefArgs};
use ksearch_core::task::{DType, Task, shape_of};

/// One tensor on the host: its values as f64 (exactly representable in `dtype`) and its bytes.
#[derive(Debug, Clone)]
pub struct HostTensor {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub values: Vec<f64>,
    pub bytes: Vec<u8>,
}

impl HostTensor {
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Fresh inputs for workload `w`, drawn from its seed.
pub fn make_inputs(task: &Task, backend: &str, w: &WorkloadReq) -> Result<Vec<HostTensor>, String> {
    task.inputs
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let shape = shape_of(t, &w.axes)?;
            let n: usize = shape.iter().product();
            let dtype = task.dtype_on(backend, t);
            let values = data::draw(&t.init, dtype, n, data::sub_seed(w.seed, i));
            let bytes = data::encode(&values, dtype);
            Ok(HostTensor {
                name: t.name.clone(),
                dtype,
                shape,
                values,
                bytes,
            })
        })
        .collect()
}

/// Output element counts and dtypes for workload `w`.
pub fn output_specs(task: &Task, backend: &str, w: &WorkloadReq) -> Result<Vec<(String, usize, DType)>, String> {
    task.outputs
        .iter()
        .map(|t| {
            Ok((
                t.name.clone(),
                shape_of(t, &w.axes)?.iter().product(),
                task.dtype_on(backend, t),
            ))
        })
        .collect()
}

/// The host f64 reference for these inputs.
pub fn host_reference(task: &Task, w: &WorkloadReq, inputs: &[HostTensor]) -> Result<Vec<Vec<f64>>, String> {
    let f = reference::lookup(&task.reference).ok_or_else(|| format!("unknown reference `{}`", task.reference))?;
    let args = RefArgs {
        axes: &w.axes,
        constants: &task.constants,
        inputs: inputs.iter().map(|t| t.values.as_slice()).collect(),
    };
    let out = f(&args);
    if out.len() != task.outputs.len() {
        return Err(format!(
            "reference `{}` returned {} outputs, task declares {}",
            task.reference,
            out.len(),
            task.outputs.len()
        ));
    }
    Ok(out)
}

/// Check every output against the reference; the merged check and the failure it implies.
pub fn check_outputs(task: &Task, backend: &str, outputs: &[Vec<u8>], refs: &[Vec<f64>]) -> (Check, Option<Failure>) {
    check_outputs_with(task, backend, outputs, refs, |i, out, r, tol| {
        data::check(out, task.dtype_on(backend, &task.outputs[i]), r, tol)
    })
}

/// `check_outputs` with the element check supplied (output index, bytes, reference, tolerance).
pub fn check_outputs_with(
    task: &Task,
    backend: &str,
    outputs: &[Vec<u8>],
    refs: &[Vec<f64>],
    check: impl Fn(usize, &[u8], &[f64], ksearch_core::task::Tolerance) -> Check,
) -> (Check, Option<Failure>) {
    let mut all = Check::default();
    let mut msg = None;
    for (i, ((spec, out), r)) in task.outputs.iter().zip(outputs).zip(refs).enumerate() {
        let dt = task.dtype_on(backend, spec);
        let tol = task
            .tolerance
            .get(&dt)
            .copied()
            .unwrap_or(ksearch_core::task::Tolerance { atol: 1e-5, rtol: 1e-4 });
        let c = check(i, out, r, tol);
        if !c.passed() && msg.is_none() {
            let (i, got, want) = c.first_bad.clone().unwrap_or((0, "?".into(), "?".into()));
            msg = Some((spec.name.clone(), i, got, want, c.clone(), tol));
        }
        all.merge(&c);
    }
    let failure = msg.map(|(name, i, got, want, c, tol)| {
        let class = if c.unwritten > 0 {
            FailureClass::Unwritten
        } else if c.nan > 0 {
            FailureClass::Nan
        } else {
            FailureClass::Wrong
        };
        let message = match class {
            FailureClass::Unwritten => format!("output `{name}`: {} of {} elements never written (first at {i})", c.unwritten, c.elements),
            FailureClass::Nan => format!("output `{name}`: {} NaN/inf elements (first at {i}: {got}, reference {want})", c.nan),
            _ => format!(
                "output `{name}`: {} of {} elements outside tolerance (atol {}, rtol {}); first at {i}: got {got}, reference {want}; max abs err {:.3e}",
                c.mismatches, c.elements, tol.atol, tol.rtol, c.max_abs_err
            ),
        };
        Failure { class, message }
    });
    (all, failure)
}
