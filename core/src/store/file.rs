//! Placeholder: replaced by the file store implementation.
/// File store (being written).
pub struct FileStore;
