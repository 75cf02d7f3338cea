{{/* Names: <release>-trainop unless the release is already called trainop. */}}
{{- define "trainop.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "trainop.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains (include "trainop.name" .) .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "trainop.name" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "trainop.selectorLabels" -}}
app.kubernetes.io/name: {{ include "trainop.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "trainop.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "trainop.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "trainop.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "trainop.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name: name an existing ServiceAccount when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The operator image; the stager and the log shipper run the same one. */}}
{{- define "trainop.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* The operator configuration file: values.config, with the image defaults filled in. */}}
{{- define "trainop.config" -}}
{{- $config := deepCopy .Values.config }}
{{- $image := include "trainop.image" . }}
{{- $_ := set $config "datastage" (merge (dict) (default (dict) $config.datastage) (dict "image" $image)) }}
{{- $_ := set $config "logship" (merge (dict) (default (dict) $config.logship) (dict "image" $image)) }}
{{- toYaml $config }}
{{- end }}

{{/* "true" when the operator serves every namespace: only on the admin's explicit clusterWide. */}}
{{- define "trainop.clusterWide" -}}
{{- if .Values.clusterWide }}true
{{- else if empty .Values.watchNamespaces }}
{{- fail "watchNamespaces: list the namespaces that train (--set 'watchNamespaces={team-a,team-b}'), or set clusterWide=true to serve every namespace" }}
{{- end }}
{{- end }}

{{/* The operator's identity as the API server names it (admission policies match on it). */}}
{{- define "trainop.username" -}}
system:serviceaccount:{{ .Release.Namespace }}:{{ include "trainop.serviceAccountName" . }}
{{- end }}

{{/* The operator creates PersistentVolumes only for DataStages onto NFS: an allowed export or
a provisioned server. Without either it needs no right on PVs at all. */}}
{{- define "trainop.managesVolumes" -}}
{{- $ds := default (dict) ((.Values.config).datastage) }}
{{- if or $ds.allowedNfsExports $ds.allowProvisionedServers }}true{{ end }}
{{- end }}

{{/* Provisioned DataStage servers on NFS-Ganesha (allowProvisionedServers, server not kernel):
the servers whose client list follows their readers, and whose pods the operator may annotate. */}}
{{- define "trainop.ganeshaServers" -}}
{{- $ds := default (dict) ((.Values.config).datastage) }}
{{- if and $ds.allowProvisionedServers (ne ($ds.server | default "ganesha") "kernel") }}true{{ end }}
{{- end }}
