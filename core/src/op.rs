//! Reduction operations: what they are, their names and which data types
//! they apply to. The host kernels that apply them are in [`crate::kernels`].

use std::fmt;

use crate::{DataType, Error, Result};

/// A reduction operation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ReduceOp {
    Sum,
    Prod,
    Min,
    Max,
    /// Sum divided by the number of ranks (integer division for integer types).
    Avg,
    /// Bitwise and (integer types only).
    BitAnd,
    /// Bitwise or (integer types only).
    BitOr,
    /// Bitwise xor (integer types only).
    BitXor,
    /// Each rank multiplies its own input by this scalar, then the inputs are
    /// summed (NCCL's `ncclRedOpCreatePreMulSum`). The scalar may differ per
    /// rank; for integer types it must be a whole number.
    PreMulSum(f64),
}

impl ReduceOp {
    /// Every op kind, with `1.0` as the pre-multiplied sum's scalar.
    pub const ALL: [ReduceOp; 9] = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Avg,
        ReduceOp::BitAnd,
        ReduceOp::BitOr,
        ReduceOp::BitXor,
        ReduceOp::PreMulSum(1.0),
    ];

    /// A tag for the op kind (the scalar of `PreMulSum` is per rank and not part of it).
    pub const fn tag(self) -> u8 {
        match self {
            ReduceOp::Sum => 1,
            ReduceOp::Prod => 2,
            ReduceOp::Min => 3,
            ReduceOp::Max => 4,
            ReduceOp::Avg => 5,
            ReduceOp::BitAnd => 6,
            ReduceOp::BitOr => 7,
            ReduceOp::BitXor => 8,
            ReduceOp::PreMulSum(_) => 9,
        }
    }

    /// Short name ("sum", "band", "premulsum", ...).
    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Avg => "avg",
            ReduceOp::BitAnd => "band",
            ReduceOp::BitOr => "bor",
            ReduceOp::BitXor => "bxor",
            ReduceOp::PreMulSum(_) => "premulsum",
        }
    }

    /// True for the ops defined on integers only.
    pub const fn is_bitwise(self) -> bool {
        matches!(self, ReduceOp::BitAnd | ReduceOp::BitOr | ReduceOp::BitXor)
    }

    /// Checks that this op may be applied to `dtype`.
    #[inline]
    pub fn validate(self, dtype: DataType) -> Result<()> {
        if self.is_bitwise() && dtype.is_float() {
            return Err(Error::InvalidArgument(format!(
                "reduction op {} is not defined for floating-point type {dtype}",
                self.name()
            )));
        }
        if let ReduceOp::PreMulSum(s) = self {
            if !s.is_finite() {
                return Err(Error::InvalidArgument(format!(
                    "premulsum scalar {s} is not finite"
                )));
            }
            if !dtype.is_float() && s.fract() != 0.0 {
                return Err(Error::InvalidArgument(format!(
                    "premulsum scalar {s} must be a whole number for integer type {dtype}"
                )));
            }
        }
        Ok(())
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReduceOp::PreMulSum(s) => write!(f, "premulsum({s})"),
            op => f.write_str(op.name()),
        }
    }
}

impl std::str::FromStr for ReduceOp {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let lower = s.to_ascii_lowercase();
        if let Some(arg) = lower
            .strip_prefix("premulsum(")
            .and_then(|r| r.strip_suffix(')'))
        {
            return arg
                .parse::<f64>()
                .map(ReduceOp::PreMulSum)
                .map_err(|_| format!("bad premulsum scalar in '{s}'"));
        }
        Ok(match lower.as_str() {
            "sum" => ReduceOp::Sum,
            "prod" => ReduceOp::Prod,
            "min" => ReduceOp::Min,
            "max" => ReduceOp::Max,
            "avg" => ReduceOp::Avg,
            "band" | "and" => ReduceOp::BitAnd,
            "bor" | "or" => ReduceOp::BitOr,
            "bxor" | "xor" => ReduceOp::BitXor,
            "premulsum" => ReduceOp::PreMulSum(1.0),
            _ => {
                return Err(format!(
                    "unknown reduction op '{s}' (expected sum, prod, min, max, avg, band, bor, bxor, premulsum)"
                ))
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validate_rejects_bitwise_on_floats_and_fractional_int_scalars() {
        for d in DataType::ALL {
            for op in [ReduceOp::BitAnd, ReduceOp::BitOr, ReduceOp::BitXor] {
                assert_eq!(op.validate(d).is_ok(), !d.is_float(), "{op} on {d}");
            }
            assert!(ReduceOp::Sum.validate(d).is_ok());
        }
        assert!(ReduceOp::PreMulSum(0.5).validate(DataType::I32).is_err());
        assert!(ReduceOp::PreMulSum(0.5).validate(DataType::F32).is_ok());
        assert!(ReduceOp::PreMulSum(f64::NAN)
            .validate(DataType::F32)
            .is_err());
    }

    #[test]
    fn parse_ops() {
        for op in ReduceOp::ALL {
            assert_eq!(op.name().parse::<ReduceOp>().unwrap().tag(), op.tag());
        }
        assert_eq!(
            "premulsum(2.5)".parse::<ReduceOp>().unwrap(),
            ReduceOp::PreMulSum(2.5)
        );
        assert!("median".parse::<ReduceOp>().is_err());
    }
}
