package source_test

import (
	"testing"

	"github.com/opencontainers/go-digest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/ref"
	"github.com/weightd/weightd/pkg/source"
)

func TestModelNameOfS3(t *testing.T) {
	t.Parallel()
	name := func(s string) string {
		r, err := ref.Parse(s)
		require.NoError(t, err)
		n := source.ModelName(r)
		require.NoError(t, content.ValidateModelName(n), s)
		return n
	}
	for _, s := range []string{"s3://models", "s3://my.bucket-1/Org/Model_v2.0", "s3://models/m/model.bin#" + digest.FromString("m").String()} {
		name(s)
	}
	a, b, c := name("s3://models/llama"), name("https://models/llama"), name("s3://models/llama@v2")
	assert.NotEqual(t, a, b, "no URL's model is laid out in an S3 model's place")
	assert.Equal(t, a, c, "versions of one prefix are revisions of one model")
}

// FuzzModelName: every S3 reference that parses names a model the cache
// accepts.
func FuzzModelName(f *testing.F) {
	for _, s := range []string{"s3://models/llama/v1", "s3://models", "s3://models/m@3/L4kqtJlcpXroDTDmJ+rmSpXd3dIbrHY=", "s3://a-b.c/x/y.z#" + digest.FromString("y").String()} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		r, err := ref.Parse(s)
		if err != nil || r.Kind != ref.KindS3 {
			return
		}
		if err := content.ValidateModelName(source.ModelName(r)); err != nil {
			t.Fatalf("%q: model name: %v", s, err)
		}
	})
}
