//! Byte buffers aligned for every element type.

/// A zero-initialised byte buffer aligned to 64 bytes (one cache line), so that
/// any slice of it that starts at a multiple of an element size can be viewed
/// as that element type.
pub struct AlignedBuf {
    words: Vec<Line>,
    len: usize,
}

#[derive(Clone, Copy, bytemuck::Zeroable, bytemuck::Pod)]
#[repr(C, align(64))]
struct Line([u8; 64]);

impl AlignedBuf {
    /// A buffer of `len` zero bytes.
    pub fn zeroed(len: usize) -> AlignedBuf {
        AlignedBuf {
            words: vec![Line([0; 64]); len.div_ceil(64)],
            len,
        }
    }

    /// Grows (never shrinks) the buffer to at least `len` bytes.
    pub fn reserve_len(&mut self, len: usize) {
        if len > self.len {
            *self = AlignedBuf::zeroed(len);
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.len]
    }

    /// The bytes, mutable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.words)[..self.len]
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBuf({} bytes)", self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_and_sized() {
        let mut b = AlignedBuf::zeroed(100);
        assert_eq!(b.len(), 100);
        assert_eq!(b.as_slice().as_ptr() as usize % 64, 0);
        b.as_mut_slice()[99] = 1;
        let v: &[f64] = bytemuck::cast_slice(&b.as_slice()[..96]);
        assert_eq!(v.len(), 12);
        b.reserve_len(10);
        assert_eq!(b.len(), 100);
        b.reserve_len(200);
        assert_eq!(b.len(), 200);
        assert!(AlignedBuf::zeroed(0).is_empty());
    }
}
