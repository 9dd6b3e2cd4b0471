//! Named paths in the system's temporary folder that remove themselves (tests and tools that
//! write files to read them back).

use std::ops::Deref;
use std::path::{Path, PathBuf};

/// A path in the system's temporary folder, unique to this process, `prefix` and `name`;
/// whatever is there when it drops (a file, or a folder and its contents) is removed, so a
/// test run leaves nothing behind. Nothing is created: write the file or make the folder.
pub struct TempPath(PathBuf);

impl TempPath {
    pub fn new(prefix: &str, name: &str) -> TempPath {
        TempPath(std::env::temp_dir().join(format!("{prefix}-{}-{name}", std::process::id())))
    }
}

impl Drop for TempPath {
    fn drop(&mut self) {
        if std::fs::remove_file(&self.0).is_err() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

impl Deref for TempPath {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for TempPath {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_and_folders_are_removed_on_drop() {
        let f = TempPath::new("ferrum-core-test", "file");
        std::fs::write(&f, b"x").unwrap();
        let d = TempPath::new("ferrum-core-test", "folder");
        std::fs::create_dir_all(d.join("inner")).unwrap();
        std::fs::write(d.join("inner/x"), b"x").unwrap();
        let (fp, dp) = (f.to_path_buf(), d.to_path_buf());
        assert!(fp.exists() && dp.exists());
        drop((f, d));
        assert!(!fp.exists() && !dp.exists());
    }
}
