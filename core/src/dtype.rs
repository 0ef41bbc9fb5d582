//! Element types that ccl moves and reduces.

use std::fmt;

use half::{bf16, f16};

/// The element type of a buffer, as it travels in frame fingerprints.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DataType {
    I8 = 1,
    U8 = 2,
    I32 = 3,
    U32 = 4,
    I64 = 5,
    U64 = 6,
    F16 = 7,
    Bf16 = 8,
    F32 = 9,
    F64 = 10,
}

impl DataType {
    /// Every data type, in declaration order.
    pub const ALL: [DataType; 10] = [
        DataType::I8,
        DataType::U8,
        DataType::I32,
        DataType::U32,
        DataType::I64,
        DataType::U64,
        DataType::F16,
        DataType::Bf16,
        DataType::F32,
        DataType::F64,
    ];

    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DataType::I8 | DataType::U8 => 1,
            DataType::F16 | DataType::Bf16 => 2,
            DataType::I32 | DataType::U32 | DataType::F32 => 4,
            DataType::I64 | DataType::U64 | DataType::F64 => 8,
        }
    }

    /// True for the floating-point types (bitwise ops are invalid on them).
    pub const fn is_float(self) -> bool {
        matches!(
            self,
            DataType::F16 | DataType::Bf16 | DataType::F32 | DataType::F64
        )
    }

    /// The short name used on the command line and in output ("f32", "bf16", ...).
    pub const fn name(self) -> &'static str {
        match self {
            DataType::I8 => "i8",
            DataType::U8 => "u8",
            DataType::I32 => "i32",
            DataType::U32 => "u32",
            DataType::I64 => "i64",
            DataType::U64 => "u64",
            DataType::F16 => "f16",
            DataType::Bf16 => "bf16",
            DataType::F32 => "f32",
            DataType::F64 => "f64",
        }
    }

    /// The value of one element of this type (native byte order) as an
    /// f64 (exact for every type but the 64-bit integers beyond 2^53);
    /// `None` unless `bytes` holds exactly one element.
    pub fn value_to_f64(self, bytes: &[u8]) -> Option<f64> {
        macro_rules! read {
            ($t:ty) => {
                <$t>::from_ne_bytes(bytes.try_into().ok()?)
            };
        }
        Some(match self {
            DataType::I8 => f64::from(read!(i8)),
            DataType::U8 => f64::from(read!(u8)),
            DataType::I32 => f64::from(read!(i32)),
            DataType::U32 => f64::from(read!(u32)),
            DataType::I64 => read!(i64) as f64,
            DataType::U64 => read!(u64) as f64,
            DataType::F16 => f16::from_bits(read!(u16)).to_f64(),
            DataType::Bf16 => bf16::from_bits(read!(u16)).to_f64(),
            DataType::F32 => f64::from(read!(f32)),
            DataType::F64 => read!(f64),
        })
    }

    /// Decodes the wire tag written by `as u8`.
    pub fn from_u8(tag: u8) -> Option<DataType> {
        DataType::ALL.into_iter().find(|d| *d as u8 == tag)
    }
}

impl fmt::Display for DataType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for DataType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let lower = s.to_ascii_lowercase();
        let alias = match lower.as_str() {
            "int8" | "char" => "i8",
            "uint8" | "byte" => "u8",
            "int32" | "int" => "i32",
            "uint32" => "u32",
            "int64" | "long" => "i64",
            "uint64" => "u64",
            "float16" | "half" => "f16",
            "bfloat16" => "bf16",
            "float32" | "float" => "f32",
            "float64" | "double" => "f64",
            other => other,
        };
        DataType::ALL
            .into_iter()
            .find(|d| d.name() == alias)
            .ok_or_else(|| format!("unknown data type '{s}' (expected one of i8, u8, i32, u32, i64, u64, f16, bf16, f32, f64)"))
    }
}

/// A Rust type that ccl can send and reduce.
///
/// Implemented for `i8, u8, i32, u32, i64, u64, half::f16, half::bf16, f32, f64`.
pub trait Element: bytemuck::Pod + Send + Sync + PartialEq + fmt::Debug + 'static {
    /// The data type tag of this Rust type.
    const DTYPE: DataType;
}

macro_rules! element {
    ($($t:ty => $d:ident),* $(,)?) => {
        $(impl Element for $t { const DTYPE: DataType = DataType::$d; })*
    };
}

element!(i8 => I8, u8 => U8, i32 => I32, u32 => U32, i64 => I64, u64 => U64,
         f16 => F16, bf16 => Bf16, f32 => F32, f64 => F64);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_element_reads_as_f64() {
        assert_eq!(
            DataType::I32.value_to_f64(&(-7i32).to_ne_bytes()),
            Some(-7.0)
        );
        assert_eq!(
            DataType::F64.value_to_f64(&0.25f64.to_ne_bytes()),
            Some(0.25)
        );
        let h = bf16::from_f64(1.5).to_bits().to_ne_bytes();
        assert_eq!(DataType::Bf16.value_to_f64(&h), Some(1.5));
        assert_eq!(DataType::I32.value_to_f64(&[0u8; 3]), None);
    }

    #[test]
    fn names_round_trip() {
        for d in DataType::ALL {
            assert_eq!(d.name().parse::<DataType>().unwrap(), d);
            assert_eq!(DataType::from_u8(d as u8), Some(d));
        }
        assert_eq!("float".parse::<DataType>().unwrap(), DataType::F32);
        assert!("f128".parse::<DataType>().is_err());
        assert_eq!(DataType::from_u8(0), None);
    }

    #[test]
    fn sizes_match_rust_types() {
        assert_eq!(DataType::F16.size(), std::mem::size_of::<f16>());
        assert_eq!(DataType::Bf16.size(), std::mem::size_of::<bf16>());
        assert_eq!(DataType::U64.size(), std::mem::size_of::<u64>());
    }
}
