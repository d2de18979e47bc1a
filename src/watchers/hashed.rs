//! Lookups by a borrowed key and its hash, and the hasher keys are hashed
//! with: the map hashes each key once, with the user's hasher, and never
//! again (it stores the hash beside the key, see `map.rs`).

use std::borrow::Borrow;
use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hash, Hasher};

/// A key looked up by reference, with its hash. Made once
/// per call by [`Watchers::probe`], so a call that looks its key up twice (a
/// walk, then the prune after its checks) hashes it once.
pub(crate) struct Probe<'a, Q: ?Sized> {
    pub(super) hash: u64,
    pub(super) key: &'a Q,
}

impl<Q: ?Sized + Eq> Probe<'_, Q> {
    /// Whether a stored key with `hash` is the one looked up: same hash,
    /// and the same key by `Eq`.
    pub(super) fn matches<K: Borrow<Q>>(&self, hash: u64, key: &K) -> bool {
        self.hash == hash && key.borrow() == self.key
    }
}

/// The hasher keys are hashed with: std's `RandomState` (the default, called
/// directly), or one the user chose, called through a trait object so that the
/// types holding the map do not carry its type.
pub(crate) enum KeyHasher {
    Std(RandomState),
    Chosen(Box<dyn HashWith>),
}

/// A `BuildHasher` seen through a trait object: builds a hasher, lets `feed`
/// write the key into it, and returns the hash.
pub(crate) trait HashWith: Send + Sync {
    fn hash_with(&self, feed: &mut dyn FnMut(&mut dyn Hasher)) -> u64;
}

/// An application's hasher, dropped with a panic of its `Drop` contained
/// (the last handle to a purgatory, or a build that failed, drops it), and
/// the name of the purgatory it serves, for the report.
struct Contained<S>(Option<S>, std::sync::Arc<str>);

impl<S: BuildHasher + Send + Sync> HashWith for Contained<S> {
    fn hash_with(&self, feed: &mut dyn FnMut(&mut dyn Hasher)) -> u64 {
        let s = self.0.as_ref().expect("present until dropped");
        let mut h = s.build_hasher();
        feed(&mut h);
        h.finish()
    }
}

impl<S> Drop for Contained<S> {
    fn drop(&mut self) {
        // Reported, not counted: nobody can read the purgatory's count now.
        crate::contain::Panics::new("purgatory", self.1.clone())
            .drop_value("a hasher's drop", self.0.take());
    }
}

impl KeyHasher {
    /// The hasher `s` of the purgatory named `name`; std's `RandomState` is
    /// recognised and called directly.
    pub(crate) fn new<S: BuildHasher + Send + Sync + 'static>(
        s: S,
        name: std::sync::Arc<str>,
    ) -> KeyHasher {
        let mut s = Some(s);
        match (&mut s as &mut dyn std::any::Any).downcast_mut::<Option<RandomState>>() {
            Some(std) => KeyHasher::Std(std.take().expect("just made")),
            None => KeyHasher::Chosen(Box::new(Contained(s, name))),
        }
    }

    pub(super) fn hash_one<Q: Hash + ?Sized>(&self, key: &Q) -> u64 {
        match self {
            KeyHasher::Std(s) => s.hash_one(key),
            KeyHasher::Chosen(s) => s.hash_with(&mut |mut h| key.hash(&mut h)),
        }
    }
}

impl Default for KeyHasher {
    fn default() -> Self {
        KeyHasher::Std(RandomState::new())
    }
}

#[cfg(all(test, not(purgatory_loom)))]
mod tests {
    use super::*;

    /// A probe matches a stored key by hash and key.
    #[test]
    fn probes_compare_hash_and_key() {
        let probe = |hash, key| Probe { hash, key };
        assert!(probe(1, &7u32).matches(1, &7));
        assert!(!probe(1, &8).matches(1, &7), "a collision is not a match");
        assert!(!probe(2, &7).matches(1, &7), "same key, other hash");
    }
}
