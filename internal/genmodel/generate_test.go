package genmodel_test

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/internal/genmodel"
)

func TestGenerate(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name  string
		spec  genmodel.Spec
		paths []string
	}{
		{"one file", genmodel.Spec{Name: "org/one", Files: 1, TotalBytes: 100_000, Seed: 1},
			[]string{"model.safetensors"}},
		{"two files", genmodel.Spec{Name: "org/two", Files: 2, TotalBytes: 100_000, Seed: 2},
			[]string{"config.json", "model.safetensors"}},
		{"three files", genmodel.Spec{Name: "org/three", Files: 3, TotalBytes: 100_000, Seed: 3},
			[]string{"config.json", "tokenizer.json", "model.safetensors"}},
		{"sharded", genmodel.Spec{Name: "org/sharded", Files: 5, TotalBytes: 3<<20 + 7, Seed: 4},
			[]string{"config.json", "tokenizer.json", "model-00001-of-00003.safetensors",
				"model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors"}},
		{"empty", genmodel.Spec{Name: "org/empty", Files: 3, TotalBytes: 0},
			[]string{"config.json", "tokenizer.json", "model.safetensors"}},
		{"fewer bytes than files", genmodel.Spec{Name: "org/tiny", Files: 6, TotalBytes: 3},
			[]string{"config.json", "tokenizer.json", "model-00001-of-00004.safetensors",
				"model-00002-of-00004.safetensors", "model-00003-of-00004.safetensors", "model-00004-of-00004.safetensors"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			m, err := genmodel.Generate(dir, tt.spec)
			require.NoError(t, err)
			assert.Equal(t, tt.spec.Name, m.Name)
			assert.Regexp(t, `^[0-9a-f]{40}$`, m.Revision)
			assert.Equal(t, tt.spec.TotalBytes, m.TotalBytes())

			var paths []string
			for _, f := range m.Files {
				paths = append(paths, f.Path)
				data, err := os.ReadFile(filepath.Join(dir, f.Path))
				require.NoError(t, err)
				assert.Len(t, data, int(f.Size), f.Path)
				sum := sha256.Sum256(data)
				assert.Equal(t, hex.EncodeToString(sum[:]), f.SHA256, f.Path)
				assert.Equal(t, "sha256:"+f.SHA256, f.Digest().String())
				if len(data) >= 64 {
					assert.NotEqual(t, make([]byte, 64), data[:64], "%s starts with zeros", f.Path)
				}
			}
			assert.Equal(t, tt.paths, paths)

			onDisk, err := os.ReadFile(filepath.Join(dir, genmodel.ManifestName))
			require.NoError(t, err)
			var got genmodel.Manifest
			require.NoError(t, json.Unmarshal(onDisk, &got))
			assert.Equal(t, *m, got)
		})
	}
}

func TestGenerateDeterministic(t *testing.T) {
	t.Parallel()
	spec := genmodel.Spec{Name: "org/det", Files: 4, TotalBytes: 1 << 20, Seed: 42}
	a, err := genmodel.Generate(t.TempDir(), spec)
	require.NoError(t, err)
	b, err := genmodel.Generate(t.TempDir(), spec)
	require.NoError(t, err)
	assert.Equal(t, a, b, "same spec, same model")

	spec.Seed++
	c, err := genmodel.Generate(t.TempDir(), spec)
	require.NoError(t, err)
	assert.NotEqual(t, a.Revision, c.Revision)
	for i := range a.Files {
		if a.Files[i].Size > 0 {
			assert.NotEqual(t, a.Files[i].SHA256, c.Files[i].SHA256, "another seed, other bytes")
		}
	}
	// Files of one model differ from each other too.
	assert.NotEqual(t, a.Files[2].SHA256, a.Files[3].SHA256)
}

func TestGenerateInvalid(t *testing.T) {
	t.Parallel()
	for _, spec := range []genmodel.Spec{
		{Name: "", Files: 1},
		{Name: "org/x", Files: 0},
		{Name: "org/x", Files: genmodel.MaxFiles + 1},
		{Name: "org/x", Files: 1, TotalBytes: -1},
	} {
		_, err := genmodel.Generate(t.TempDir(), spec)
		assert.Error(t, err, "%+v", spec)
	}
}

func BenchmarkGenerate(b *testing.B) {
	for _, size := range []int64{16 << 20, 256 << 20, 1 << 30} {
		for _, files := range []int{1, 4} {
			b.Run(fmt.Sprintf("%dMiB/files=%d", size>>20, files), func(b *testing.B) {
				dir := b.TempDir()
				b.SetBytes(size)
				for i := 0; b.Loop(); i++ {
					if _, err := genmodel.Generate(dir, genmodel.Spec{Name: "org/bench", Files: files, TotalBytes: size, Seed: uint64(i)}); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}
