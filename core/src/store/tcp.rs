//! Placeholder: replaced by the TCP store implementation.
/// TCP store client (being written).
pub struct TcpStore;
/// TCP store server (being written).
pub struct TcpStoreServer;
