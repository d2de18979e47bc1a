//! What both watcher maps hand back.

/// What a call took out of the map, to be dropped by the caller once no lock is
/// held: list entries and the map's own copies of keys that left it.
#[derive(Debug)]
pub(crate) struct Removed<K, V> {
    pub(crate) entries: Vec<V>,
    pub(crate) keys: Vec<K>,
}

impl<K, V> Default for Removed<K, V> {
    fn default() -> Self {
        Removed {
            entries: Vec::new(),
            keys: Vec::new(),
        }
    }
}
